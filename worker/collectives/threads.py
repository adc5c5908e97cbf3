"""The one way a compute thread calls into the event loop its group's collectives run on."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from shardwire.protocol.errors import InvalidState

T = TypeVar("T")


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
