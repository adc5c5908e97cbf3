"""Hierarchical collectives for a group laid out over several nodes: each node's ranks
work through their node arena, and only the *lanes* cross between nodes.

With L ranks on each of k nodes (see :func:`~.layout.node_layout`; nodes of different
sizes go through their leaders instead, see ``collectives.leaders``), the lane of a rank
is its index j among its node's ranks; the ranks of lane j, one per node, form a
cross-node subgroup. Every byte crosses between nodes once per phase, on all L lanes
at once; the rest happens inside the nodes, where the node subgroup runs its calls on
the arena (or over its own links when the node has no arena):

* all_reduce: a reduce_scatter inside the node (local rank j ends with the node's sum
  of segment j), an all_reduce of segment j over lane j, an all_gather inside the node.
* reduce_scatter: inside the node, the pieces bound for lane j (one per node) are
  reduced onto local rank j; then a reduce_scatter over lane j.
* all_gather: an all_gather over lane j (the parts of lane j from every node), then an
  all_gather of those inside the node, unpacked into rank order.
* broadcast: over the root's lane, then inside every node from that lane's rank.

Both subgroups are made from the member lists alone (no messages), by every rank for
the subgroups it belongs to. A group's hierarchical calls run one after another in call
order (:meth:`Tiers.reserve`), so their subgroup calls are made in the same order on
every rank however the caller awaits them. A subgroup call that fails poisons the whole
group, so every member fails the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from shardwire.protocol import ShardwireError
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.layout import bounds
from shardwire.worker.collectives.ops import ReduceOp, finish

if TYPE_CHECKING:
    from shardwire.worker.collectives.group import Group

Segments = list[tuple[int, int]]
# Runs one call's phases in the call's place in the group's order.
Runner = Callable[[Call, Callable[[], Awaitable[None]]], Awaitable[None]]


class Phases:
    """The subgroups of a group laid out over nodes, and the order of its hierarchical
    calls: the node's group (``local``) and the group this rank crosses nodes in
    (``across``; None for a rank that does not cross)."""

    def __init__(self, group: Group, layout: list[list[int]]) -> None:
        self.group = group
        self.layout = layout
        self.node, self.index = next(
            (n, ranks.index(group.rank)) for n, ranks in enumerate(layout) if group.rank in ranks
        )
        self.local = group.new_group(layout[self.node], name=f"~node:{group.group_id}")
        self.across: Group | None = None
        self._tail: asyncio.Future[None] | None = None

    def reserve(self) -> Runner:
        """Take the next place in the call order (when the call is made); returns how to
        run the call's phases in that place."""
        before, mine = self._tail, asyncio.get_running_loop().create_future()
        self._tail = mine

        async def run(c: Call, phases: Callable[[], Awaitable[None]]) -> None:
            try:
                if before is not None:
                    await asyncio.shield(before)
                for group in self.subgroups():
                    group.within = c.signature
                if c.split is not None:
                    c.split.composed = True
                await phases()
            except (ShardwireError, OSError) as exc:  # tell the node and the whole group
                for group in (*self.subgroups(), self.group):
                    group.fail(exc)
                raise
            finally:
                if not mine.done():
                    mine.set_result(None)

        return run

    def subgroups(self) -> list[Group]:
        """The subgroups this rank's phases run in (the group's deadline asks them who
        its phases wait for)."""
        return [self.local] if self.across is None else [self.local, self.across]


class Tiers(Phases):
    """Every node holds the same number of ranks: each lane crosses between nodes."""

    def __init__(self, group: Group, layout: list[list[int]]) -> None:
        super().__init__(group, layout)
        self.lane = self.index
        lane = [ranks[self.lane] for ranks in layout]
        self.lanes = group.new_group(lane, name=f"~lane{self.lane}:{group.group_id}")
        self.across = self.lanes

    # ---- the four collectives --------------------------------------------------------

    async def all_reduce(self, c: Call, buf: np.ndarray, op: ReduceOp, limit: float) -> None:
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        segs = bounds(buf.size, len(self.layout[self.node]))
        sizes = [b - a for a, b in segs]
        part = c.scratch(sizes[self.lane], buf.dtype)
        await self.local.reduce_scatter(buf, inner, sizes=sizes, out=part, timeout=limit)
        await self.lanes.all_reduce(part, inner, timeout=limit)
        await self.local.all_gather(part, sizes=sizes, out=buf, timeout=limit)
        finish(op, buf, c.size)

    async def reduce_scatter(
        self,
        c: Call,
        src: np.ndarray,
        segs: Segments,
        out: np.ndarray,
        *,
        op: ReduceOp,
        limit: float,
    ) -> None:
        """``out`` (flat) gets segment ``segs[rank]`` of ``src`` reduced over the group."""
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        order = [ranks[j] for j in range(len(self.layout[0])) for ranks in self.layout]
        staged = c.scratch(src.size, src.dtype)
        at = 0
        for r in order:  # the pieces bound for lane 0 (node by node), then lane 1, ...
            a, b = segs[r]
            np.copyto(staged[at : at + b - a], src[a:b])
            at += b - a
        lane_sizes = [
            [segs[ranks[j]][1] - segs[ranks[j]][0] for ranks in self.layout]
            for j in range(len(self.layout[0]))
        ]
        mine = c.scratch(sum(lane_sizes[self.lane]), src.dtype)
        await self.local.reduce_scatter(
            staged, inner, sizes=[sum(s) for s in lane_sizes], out=mine, timeout=limit
        )
        await self.lanes.reduce_scatter(
            mine, inner, sizes=lane_sizes[self.lane], out=out, timeout=limit
        )
        finish(op, out, c.size)

    async def all_gather(self, c: Call, buf: np.ndarray, segs: Segments, limit: float) -> None:
        """Every ``buf[segs[r]]`` gets rank r's part (this rank filled its own)."""
        lanes = range(len(self.layout[0]))
        lane_sizes = [
            [segs[ranks[j]][1] - segs[ranks[j]][0] for ranks in self.layout] for j in lanes
        ]
        a, b = segs[c.rank]
        mine = c.scratch(sum(lane_sizes[self.lane]), buf.dtype)
        await self.lanes.all_gather(buf[a:b], sizes=lane_sizes[self.lane], out=mine, timeout=limit)
        packed = c.scratch(buf.size, buf.dtype)
        await self.local.all_gather(
            mine, sizes=[sum(s) for s in lane_sizes], out=packed, timeout=limit
        )
        at = 0
        for j in lanes:
            for ranks in self.layout:
                s, e = segs[ranks[j]]
                np.copyto(buf[s:e], packed[at : at + e - s])
                at += e - s

    async def broadcast(self, buf: np.ndarray, root: int, limit: float) -> None:
        node, lane = next(
            (n, ranks.index(root)) for n, ranks in enumerate(self.layout) if root in ranks
        )
        if self.lane == lane:
            await self.lanes.broadcast(buf, root=node, timeout=limit)
        await self.local.broadcast(buf, root=lane, timeout=limit)
