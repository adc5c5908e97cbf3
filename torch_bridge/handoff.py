"""How a torch process group's method hands its calls to shardwire's loop.

A method stages its tensors (zero-copy where numpy can view them, see ``tensors``) and
gives :meth:`Handoff.submit` a function that makes its shardwire calls. That function
runs on the loop and makes every call before the first ``await``; the loop starts
submissions in order; so every rank places its calls in the order torch made them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from shardwire.torch.loopthread import LoopThread
from shardwire.torch.tensors import Staged
from shardwire.torch.work import BridgeWork
from shardwire.worker.collectives import Group

Calls = Callable[[], Sequence[Awaitable[Any]]]
T = TypeVar("T")


class Handoff:
    """One shardwire group's calls, made on the loop thread, as torch ``Work``: the
    group's default time limit, and the name its errors give the torch group."""

    __slots__ = ("_engine", "group", "name", "timeout")

    def __init__(self, engine: LoopThread, group: Group, timeout: float) -> None:
        self._engine = engine
        self.group = group
        self.timeout = timeout
        self.name = ""  # the torch group's, once torch sets it

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on shardwire's loop and wait for it, at most ``timeout`` seconds
        (from a torch thread: a training loop, or DCP's asynchronous save)."""
        return self._engine.run(coro, timeout)

    def limit(self, opts: Any) -> float:
        """The call's time limit: its options' timeout where set, else the group's."""
        timeout: timedelta | None = getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        return seconds if seconds > 0 else self.timeout

    def submit(
        self,
        op: str,
        calls: Calls,
        result: list[torch.Tensor],
        *,
        timeout: float,
        after: Sequence[Staged] = (),
        finish: Callable[[], None] | None = None,
        source: Callable[[list[Any]], int] | None = None,
    ) -> BridgeWork:
        """Make ``calls`` on the loop, await them in order, then write staged outputs
        back (``after``, then ``finish``); torch gets ``result`` from the Work's future.
        ``source``: the sending rank, from the calls' results (receives only)."""

        async def run() -> list[Any]:
            pending = calls()
            results = [await call for call in pending]
            for staged in after:
                staged.finish()
            if finish is not None:
                finish()
            return results

        future = self._engine.submit(run())
        where = f"{op} on group {self.name or '?'} (rank {self.group.rank})"
        return BridgeWork(self._engine, future, result, op=where, limit=timeout, source=source)
