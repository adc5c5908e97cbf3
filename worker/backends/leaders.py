"""Hierarchical collectives for a group whose nodes hold different numbers of ranks:
each node's first rank, its *leader*, crosses between nodes; everything else happens
inside the node, through its arena.

Lanes (``backends.tiered``) need the same number of ranks on every node. Here one
cross-node subgroup, the leaders, carries each byte between nodes as often as the
lanes would; the node phases move more bytes than the lanes' do, but through shared
memory. Every rank of a node makes the same node calls in the same order; only the
leaders make the cross-node ones.

* all_reduce: a reduce onto the leader inside the node (a reduce_scatter whose other
  parts are empty), an all_reduce over the leaders, a broadcast inside the node.
* reduce_scatter: the same reduce onto the leader, then a reduce_scatter over the
  leaders that hands each node the block of its ranks' segments, then a broadcast of
  the block inside the node, from which each rank takes its segment.
* all_gather: an all_gather inside the node (the node's block), an all_gather of the
  blocks over the leaders, a broadcast of the whole inside the node.
* broadcast: inside the root's node from the root, over the leaders from the root's
  node, then inside every other node from its leader.
"""

from __future__ import annotations

import numpy as np

from shardwire.worker.backends.base import Subgroup
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.tiered import NewGroup, Segments, TieredBackend
from shardwire.worker.kernels.reduce import ReduceOp, finish


class Leaders(TieredBackend):
    """The node and leader subgroups of a group over nodes of different sizes."""

    __slots__ = ()

    def _across(self, new_group: NewGroup, group_id: int) -> Subgroup | None:
        if self.index != 0:
            return None
        return new_group([ranks[0] for ranks in self.layout], f"~leaders:{group_id}")

    def _leader_scratch(self, c: Call, src: np.ndarray) -> np.ndarray:
        """Scratch for the node's reduction of ``src`` (empty except on the leader)."""
        return c.scratch(src.size if self.index == 0 else 0, src.dtype)

    async def _reduce(self, src: np.ndarray, into: np.ndarray, op: ReduceOp, limit: float) -> None:
        """``into`` (the leader's) becomes ``src`` reduced over the node."""
        sizes = [src.size] + [0] * (len(self.layout[self.node]) - 1)
        await self.local.reduce_scatter(src, op, sizes=sizes, out=into, timeout=limit)

    async def all_reduce(self, c: Call, buf: np.ndarray, op: ReduceOp, limit: float) -> None:
        inner = ReduceOp.SUM if op is ReduceOp.AVG else op
        part = self._leader_scratch(c, buf)
        await self._reduce(buf, part, inner, limit)
        if self.across is not None:
            await self.across.all_reduce(part, inner, timeout=limit)
            np.copyto(buf, part)
        await self.local.broadcast(buf, root=0, timeout=limit)
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
        staged = c.scratch(src.size, src.dtype)  # node by node, each node's ranks in order
        at = 0
        for ranks in self.layout:
            for r in ranks:
                a, b = segs[r]
                np.copyto(staged[at : at + b - a], src[a:b])
                at += b - a
        blocks = [sum(segs[r][1] - segs[r][0] for r in ranks) for ranks in self.layout]
        part = self._leader_scratch(c, staged)
        await self._reduce(staged, part, inner, limit)
        block = c.scratch(blocks[self.node], src.dtype)
        if self.across is not None:
            await self.across.reduce_scatter(part, inner, sizes=blocks, out=block, timeout=limit)
        await self.local.broadcast(block, root=0, timeout=limit)
        ranks = self.layout[self.node]
        start = sum(segs[r][1] - segs[r][0] for r in ranks[: self.index])
        np.copyto(out, block[start : start + out.size])
        finish(op, out, c.size)

    async def all_gather(self, c: Call, buf: np.ndarray, segs: Segments, limit: float) -> None:
        """Every ``buf[segs[r]]`` gets rank r's part (this rank filled its own)."""
        sizes = [[segs[r][1] - segs[r][0] for r in ranks] for ranks in self.layout]
        a, b = segs[c.rank]
        block = c.scratch(sum(sizes[self.node]), buf.dtype)
        await self.local.all_gather(buf[a:b], sizes=sizes[self.node], out=block, timeout=limit)
        packed = c.scratch(buf.size, buf.dtype)
        if self.across is not None:
            blocks = [sum(s) for s in sizes]
            await self.across.all_gather(block, sizes=blocks, out=packed, timeout=limit)
        await self.local.broadcast(packed, root=0, timeout=limit)
        at = 0
        for ranks in self.layout:
            for r in ranks:
                s, e = segs[r]
                np.copyto(buf[s:e], packed[at : at + e - s])
                at += e - s

    async def broadcast(self, buf: np.ndarray, root: int, limit: float) -> None:
        node, index = next(
            (n, ranks.index(root)) for n, ranks in enumerate(self.layout) if root in ranks
        )
        if self.node == node:
            await self.local.broadcast(buf, root=index, timeout=limit)
        if self.across is not None:
            await self.across.broadcast(buf, root=node, timeout=limit)
        if self.node != node:
            await self.local.broadcast(buf, root=0, timeout=limit)
