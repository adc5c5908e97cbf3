"""shardwire's event loop on a thread of its own, for torch's threads to call into.

torch calls a backend from its own threads (the training loop, autograd's hooks) and
expects a ``Work`` back at once. The collectives are coroutines of one event loop, so
the bridge runs that loop on the ``shardwire-loop`` thread: a torch thread hands it a
coroutine (``run_coroutine_threadsafe``, which keeps the order calls were made in) and
gets a ``concurrent.futures.Future``. Numpy copies and reductions release the GIL, so the
loop moves data while torch computes.

torch futures are completed on a second thread, ``shardwire-torch-done``: torch runs a
future's callbacks (DDP's bucket hooks) on the thread that completes it, and a callback
that waited for another collective on the loop's own thread would never return.

Both threads are daemons owned by :class:`LoopThread`: :meth:`close` stops and joins them,
and the bridge closes the loop thread when the default group is destroyed or the process
exits (a daemon, so an exit without ``destroy_process_group`` is not held up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shardwire.protocol.errors import InvalidState

T = TypeVar("T")

_START_TIMEOUT = 30.0


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """The loop thread and the completion thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="shardwire-loop", daemon=True)
        self._done = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="shardwire-torch-done"
        )
        self._closed = False

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise InvalidState(f"shardwire's loop thread did not start in {_START_TIMEOUT:.0f} s")

    def _main(self) -> None:
        loop = self._loop = _new_loop()
        asyncio.set_event_loop(loop)
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @property
    def on_loop(self) -> bool:
        """Whether the caller runs on the loop thread (where it must not block)."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; calls are started in the order they were submitted."""
        if self._loop is None or self._closed:
            coro.close()
            raise InvalidState("shardwire's loop is not running (the process group was destroyed)")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result, at most ``timeout`` seconds."""
        if self.on_loop:
            coro.close()
            raise InvalidState("a blocking shardwire call was made on shardwire's own loop")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the completion thread."""
        self._done.submit(fn, *args)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop (cancelling what still runs on it) and join both threads."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        self._done.shutdown(wait=True)
