"""Hierarchical collectives for a group laid out over several nodes: each node's ranks
work through their node arena, and only the *lanes* cross between nodes.

With L ranks on each of k nodes (``kernels.segments.node_layout``; nodes of different
sizes go through their leaders instead, see ``backends.leaders``), the lane of a rank
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
order (:meth:`TieredBackend.reserve`), so their subgroup calls are made in the same order on
every rank however the caller awaits them. A subgroup call that fails poisons the whole
group, so every member fails the same way.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from shardwire.protocol import ShardwireError
from shardwire.worker.backends.algorithms import Algorithm
from shardwire.worker.backends.base import Backend, Decision, PlacedCall, Subgroup
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.ops import AllGather, AllReduce, Broadcast, Op, ReduceScatter
from shardwire.worker.backends.peerlinks import LinksBackend
from shardwire.worker.kernels.reduce import ReduceOp, finish
from shardwire.worker.kernels.segments import bounds

Segments = list[tuple[int, int]]
# Runs one call's phases in the call's place in the group's order.
Runner = Callable[[Call, Callable[[], Awaitable[None]]], Awaitable[None]]
# Makes (or returns the open) subgroup of the given group ranks, by name.
NewGroup = Callable[[list[int], str], Subgroup]
_TIERED = Decision("tiered", Algorithm.TIERS)


class TieredBackend(Backend):
    """A group laid out over nodes: the node's group (``local``) and the group this rank
    crosses nodes in (``across``; None for a rank that does not cross), and the order
    of the group's tiered calls. The other ops run over the group's own links."""

    __slots__ = ("_tail", "across", "index", "layout", "links", "local", "node", "on_failure")
    name = "tiered"

    def __init__(
        self,
        links: LinksBackend,
        layout: list[list[int]],
        *,
        rank: int,
        new_group: NewGroup,
        group_id: int,
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.links = links
        self.layout = layout
        self.on_failure = on_failure  # poisons the group these phases belong to
        self.node, self.index = next(
            (n, ranks.index(rank)) for n, ranks in enumerate(layout) if rank in ranks
        )
        self.local = new_group(layout[self.node], f"~node:{group_id}")
        self.across: Subgroup | None = self._across(new_group, group_id)
        self._tail: asyncio.Future[None] | None = None

    @abc.abstractmethod
    def _across(self, new_group: NewGroup, group_id: int) -> Subgroup | None:
        """The group this rank crosses nodes in (None: it does not cross)."""

    def decide(self, op: Op) -> Decision:
        return _TIERED if type(op) in _PHASED else self.links.decide(op)

    def launch(self, op: Op, call: Call, decision: Decision, limit: float) -> PlacedCall:
        if decision is not _TIERED:
            return self.links.launch(op, call, decision, limit)
        run = self.reserve()
        phases = self._phases(op, call, limit)

        async def tiered(c: Call) -> Any:
            await run(c, phases)
            return op.result

        return PlacedCall(tiered)

    def _phases(self, op: Op, c: Call, limit: float) -> Callable[[], Awaitable[None]]:
        if isinstance(op, AllReduce):
            return lambda: self.all_reduce(c, op.buf, op.op, limit)
        if isinstance(op, ReduceScatter):
            return lambda: self.reduce_scatter(c, op.src, op.segs, op.out, op=op.op, limit=limit)
        if isinstance(op, AllGather):

            async def gather() -> None:
                a, b = op.segs[c.rank]
                np.copyto(op.buf[a:b], op.src)
                await self.all_gather(c, op.buf, op.segs, limit)

            return gather
        assert isinstance(op, Broadcast)
        return lambda: self.broadcast(op.buf, op.root, limit)

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
                for group in self.subgroups():
                    group.fail(exc)
                self.on_failure(exc)
                raise
            finally:
                if not mine.done():
                    mine.set_result(None)

        return run

    def subgroups(self) -> Sequence[Subgroup]:
        """The subgroups this rank's phases run in (the group's deadline asks them who
        its phases wait for)."""
        return [self.local] if self.across is None else [self.local, self.across]

    @abc.abstractmethod
    async def all_reduce(self, c: Call, buf: np.ndarray, op: ReduceOp, limit: float) -> None:
        """``buf`` becomes its reduction over the group."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    async def all_gather(self, c: Call, buf: np.ndarray, segs: Segments, limit: float) -> None:
        """Every ``buf[segs[r]]`` gets rank r's part (this rank filled its own)."""

    @abc.abstractmethod
    async def broadcast(self, buf: np.ndarray, root: int, limit: float) -> None:
        """``buf`` becomes the root's on every rank."""


_PHASED = frozenset({AllReduce, ReduceScatter, AllGather, Broadcast})


class Lanes(TieredBackend):
    """Every node holds the same number of ranks: each lane crosses between nodes."""

    __slots__ = ()

    def _across(self, new_group: NewGroup, group_id: int) -> Subgroup:
        lane = [ranks[self.index] for ranks in self.layout]
        return new_group(lane, f"~lane{self.index}:{group_id}")

    @property
    def lane(self) -> int:
        return self.index

    @property
    def lanes(self) -> Subgroup:
        assert self.across is not None
        return self.across

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
