"""Running a worker's event loop (uvloop when installed, the stock loop otherwise), and
the one way a compute thread calls into it (:class:`LoopBridge`)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shardwire.protocol import JobAborted
from shardwire.protocol.errors import InvalidState
from shardwire.worker.runtime.settings import NotLaunched

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a fresh event loop.

    A process stopped because another rank failed exits with status 1 and one line
    naming that rank; the failed rank's own traceback is printed by that rank.
    """
    try:
        if use_uvloop:
            try:
                import uvloop
            except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
                pass
            else:
                return uvloop.run(main)
        return asyncio.run(main)
    except NotLaunched as exc:  # a script run by hand: the command, not a traceback
        print(f"shardwire: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except JobAborted as exc:
        print(f"shardwire: stopped: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGINT: the user knows why, no traceback
        print("shardwire: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


class LoopBridge:
    """Calls from a compute thread into the event loop it was made on.

    numpy layers compute in a worker thread (FSDP's, or ``asyncio.to_thread``) so the loop
    stays free to move bytes. The thread *waits* for a coroutine run on the loop (its
    parameters, a tensor-parallel collective), or *posts* a call without waiting; posted
    calls run on the loop in order, before anything the thread asks for later, and an
    error in one is kept for :meth:`raise_pending`.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, timeout: float):
        self.loop = loop
        self.timeout = timeout
        self.wait_s = 0.0  # compute time spent blocked on the loop
        self._error: BaseException | None = None
        self._loop_thread = threading.get_ident()

    def wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """Block this thread until ``coro`` has run on the loop; its result."""
        if threading.get_ident() == self._loop_thread:
            coro.close()
            raise InvalidState(
                "layers that run collectives compute off the event loop: run the model "
                "with asyncio.to_thread (or inside FSDP)"
            )
        start = time.perf_counter()
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=self.timeout)
        finally:
            self.wait_s += time.perf_counter() - start

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, in order, without waiting for it."""
        self.loop.call_soon_threadsafe(self._run, fn, args)

    def _run(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as exc:  # raised to the pass's caller by raise_pending()
            self._error = self._error or exc

    def raise_pending(self) -> None:
        """Raise the first error of a posted call since the last check (on the loop)."""
        error, self._error = self._error, None
        if error is not None:
            raise error
