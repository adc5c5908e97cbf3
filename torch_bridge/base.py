"""What every method of the torch process group shares: identity, and handing a call to
shardwire's loop.

A method stages its tensors (zero-copy where numpy can view them, see ``tensors``) and
gives :meth:`BridgeBase._submit` a function that makes its shardwire calls. That function
runs on the loop and makes every call before the first ``await``; the loop starts
submissions in order; so every rank places its calls in the order torch made them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardwire.torch.loopthread import LoopThread
from shardwire.torch.tensors import Staged
from shardwire.torch.work import BridgeWork
from shardwire.worker.collectives import Group

Calls = Callable[[], Sequence[Awaitable[Any]]]
T = TypeVar("T")


def bridged(pg: Any) -> BridgeBase | None:
    """The shardwire group behind torch process group ``pg`` (None: another backend)."""
    if isinstance(pg, BridgeBase):  # the backend's own group (its extended API)
        return pg
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return backend if isinstance(backend, BridgeBase) else None


class BridgeBase(dist.ProcessGroup):
    """A torch process group over one shardwire group (the world or a subgroup)."""

    def __init__(
        self, engine: LoopThread, group: Group, *, timeout: float, on_shutdown: Callable[[], None]
    ):
        super().__init__(group.rank, group.size)
        self._engine = engine
        self._group = group
        self._timeout = timeout
        self._on_shutdown = on_shutdown
        self._name = ""
        self._desc = ""

    # torch keeps neither name nor description for a group written in Python; DeviceMesh
    # and FSDP2 read them back ("ProcessGroup name not set" otherwise).

    def getBackendName(self) -> str:
        return "shardwire"

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc
    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices whose tensors the group's collectives take: the CPU's. torch's
        Python side asks (``dcp.async_save`` refuses a group without a CPU backend); a
        group written in Python registers no backend with torch's C++ side to tell it."""
        return [torch.device("cpu")]

    @property
    def shardwire_group(self) -> Group:
        """The shardwire group this torch group runs on."""
        return self._group

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on shardwire's loop and wait for it, at most ``timeout`` seconds
        (from a torch thread: a training loop, or DCP's asynchronous save)."""
        return self._engine.run(coro, timeout)

    def __repr__(self) -> str:
        g = self._group
        return f"ShardwireProcessGroup(rank={g.rank}, size={g.size}, name={self._name!r})"

    def shutdown(self) -> None:
        """``destroy_process_group``: close the shardwire group (the default group's
        shutdown leaves the job and stops shardwire's loop)."""
        self._on_shutdown()

    def abort(self) -> None:
        self._on_shutdown()

    def _limit(self, opts: Any) -> float:
        """The call's time limit: its options' timeout where set, else the group's."""
        timeout: timedelta | None = getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        return seconds if seconds > 0 else self._timeout

    def _submit(
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
        where = f"{op} on group {self._name or '?'} (rank {self._group.rank})"
        return BridgeWork(self._engine, future, result, op=where, limit=timeout, source=source)
