"""The module hooks through which FSDP's compute thread reaches the event loop.

FSDP runs the model's numpy forward and backward in a worker thread, so the event loop
stays free to move bytes meanwhile. Each unit's module is wrapped: before it computes,
the compute thread *waits* for the unit's parameters (a coroutine run on the loop; the
time blocked is what prefetch failed to hide); after it computes, it *posts* the rest
(free the parameters, start the gradient reduction) to the loop without waiting, through
the :class:`~shardwire.worker.runtime.loop.LoopBridge`. An error in a posted call is
raised by ``raise_pending`` when the pass returns.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from shardwire.worker.collectives.threads import LoopBridge
from shardwire.worker.nn.module import Module


def hook_module(
    module: Module,
    bridge: LoopBridge,
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
