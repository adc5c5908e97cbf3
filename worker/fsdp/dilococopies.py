"""Live recovery of a DiLoCo run: peer copies of each replica's state, and the outer
state taken back from the survivors.

A DiLoCo rank holds two kinds of state. Its inner state (its replica's FSDP shards and
inner optimizer) is its replica's alone: :class:`DiLoCoCopies` copies it, every
``every`` steps, to the same local rank on the next node, which is another replica's
rank (one replica per node), and restores it only into the same replica. Its outer
state (the global parameters, each fragment's outer momentum, the round's position and
the sum of an exchange in flight) is the same, bit for bit, in every rank of its outer
group, since they all apply the same outer steps to the same sums: nothing of it
crosses the wire while training; each rank keeps its own at each copy step, and after a
re-formation the outer group takes it from a survivor's memory (the lowest rank holding
that step), checking that every survivor's is the same. What one exchange in flight
sent is the replica's parameters of the step it started after, which the inner copy
restores.

The steps restored are those :class:`~shardwire.worker.fsdp.PeerCopies` restores (the
newest step every rank's inner copy is held for), so a run recovered live goes on
exactly as it would have without the failure. The replicas must be as many, and as
large, as before (a re-formed job of another shape loads its disk checkpoint).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwire.protocol.errors import InvalidState
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp.copyplan import Snapshot, pack
from shardwire.worker.fsdp.peercopy import PeerCopies
from shardwire.worker.fsdp.persist import Resumed
from shardwire.worker.fsdp.wrapper import FSDP
from shardwire.worker.training.diloco import DiLoCo
from shardwire.worker.training.outer_state import flatten, unflatten

__all__ = ["DiLoCoCopies"]


class DiLoCoCopies(PeerCopies):
    """:class:`~shardwire.worker.fsdp.PeerCopies` for a DiLoCo run: make one per
    process, and :meth:`bind` each generation's :class:`DiLoCo` to it before
    :meth:`restore` (after :meth:`DiLoCo.begin`); then :meth:`save` after every step,
    after the step's :meth:`DiLoCo.step`."""

    def __init__(self, every: int, **kwargs: Any) -> None:
        super().__init__(every, **kwargs)
        self._outer: dict[int, Snapshot] = {}
        self._diloco: DiLoCo | None = None

    def bind(self, diloco: DiLoCo, world: Group, replica: int) -> None:
        """This generation's DiLoCo, the group of all its replicas' ranks (``world``)
        and this rank's replica."""
        self._diloco = diloco
        self.replicas(world, replica)

    def _bound(self) -> DiLoCo:
        if self._diloco is None:
            raise InvalidState("DiLoCoCopies: bind() this generation's DiLoCo first")
        return self._diloco

    async def save(
        self,
        fsdp: FSDP,
        step: int,
        *,
        rngs: dict[str, np.random.Generator] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        diloco = self._bound()
        if step % self.every == 0:
            self._keep(self._outer, await _outer_snapshot(diloco, step))
        await super().save(fsdp, step, rngs=rngs, extra=extra)

    async def restore(
        self, fsdp: FSDP, *, rngs: dict[str, np.random.Generator] | None = None
    ) -> Resumed | None:
        diloco = self._bound()
        resumed = await super().restore(fsdp, rngs=rngs)
        if resumed is not None:
            await self._take_outer(diloco, resumed.step)
        for later in [s for s in self._outer if resumed is None or s > resumed.step]:
            del self._outer[later]
        return resumed

    async def _take_outer(self, diloco: DiLoCo, step: int) -> None:
        """Adopt the outer state of ``step`` from the lowest rank of the outer group that
        kept it (every such rank's must be the same)."""
        group = diloco.group
        where = f"rank {group.ranks[group.rank]}'s outer group"
        mine = self._outer.get(step)
        said = await group.all_gather_object(None if mine is None else mine.meta["digest"])
        holders = [r for r, digest in enumerate(said) if digest is not None]
        if not holders:
            raise InvalidState(
                f"DiLoCo's outer state at step {step} is held by no rank of {where}: "
                "every replica's rank there was lost"
            )
        if len({said[r] for r in holders}) > 1:
            raise InvalidState(
                f"DiLoCo's outer state at step {step} differs between the ranks of {where} "
                f"that kept it (its ranks {holders[:8]})"
            )
        root = holders[0]
        ours = mine.meta if mine is not None and group.rank == root else None
        meta = await group.broadcast_object(ours, root=root)
        # a holder's bytes are the root's (the same digest): it sends or keeps its own
        data = mine.data if mine is not None else np.empty(_nbytes(meta), np.uint8)
        data = await group.broadcast(data, root=root)
        snap = Snapshot(meta, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        if not snap.intact():
            raise InvalidState(
                f"DiLoCo's outer state at step {step} from rank {group.ranks[root]} of {where} "
                "does not match its digest"
            )
        state = unflatten(dict(snap.views()), meta["outer"])
        diloco.load_state_dict(state)
        self._outer[step] = snap


async def _outer_snapshot(diloco: DiLoCo, step: int) -> Snapshot:
    """The outer state after inner step ``step`` (an exchange in flight received first),
    without what this replica sent (its parameters of this step: the inner copy's)."""
    state = await diloco.state_dict()
    if state["flight"] is not None:
        if state["flight"]["started"] != state["steps"]:
            raise InvalidState("DiLoCo's state is copied only after DiLoCo.step()")
        state["flight"] = {**state["flight"], "sent": None}
    tensors, meta = flatten(state)
    return pack(sorted(tensors.items()), {"step": step, "outer": meta})


def _nbytes(meta: dict[str, Any]) -> int:
    layout = meta["layout"]
    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _n, shape, dtype in layout)
