"""The bridge between the compute thread and the event loop, and the module hooks.

FSDP runs the model's numpy forward and backward in a worker thread, so the event loop
stays free to move bytes meanwhile. Each unit's module is wrapped: before it computes,
the compute thread *waits* for the unit's parameters (a coroutine run on the loop; the
time blocked is what prefetch failed to hide); after it computes, it *posts* the rest
(free the parameters, start the gradient reduction) to the loop without waiting. Posted
calls run on the loop in order, before anything the compute thread asks for later; an
error in one is kept and raised by :meth:`Bridge.raise_pending` when the pass returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from shardwire.worker.nn.module import Module


class Bridge:
    """Calls from the compute thread into one event loop (captured at creation)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, timeout: float):
        self.loop = loop
        self.timeout = timeout
        self.wait_s = 0.0  # compute time spent blocked on the loop
        self._error: BaseException | None = None

    def wait(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Block the compute thread until ``coro`` has run on the loop."""
        start = time.perf_counter()
        try:
            asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=self.timeout)
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


def hook_module(
    module: Module,
    bridge: Bridge,
    *,
    before_forward: Callable[[], Coroutine[Any, Any, None]],
    after_forward: Callable[[], None],
    before_backward: Callable[[], Coroutine[Any, Any, None]],
    after_backward: Callable[[], None],
) -> None:
    """Wrap ``module``'s forward and backward with the unit's hooks."""
    forward, backward = module.forward, module.backward

    def hooked_forward(x: np.ndarray) -> np.ndarray:
        bridge.wait(before_forward())
        y = forward(x)
        bridge.post(after_forward)
        return y

    def hooked_backward(dy: np.ndarray) -> np.ndarray:
        bridge.wait(before_backward())
        dx = backward(dy)
        bridge.post(after_backward)
        return dx

    module.forward = hooked_forward  # type: ignore[method-assign]
    module.backward = hooked_backward  # type: ignore[method-assign]
