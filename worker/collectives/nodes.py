"""Node-aware algorithms for large payloads: shared memory inside a node, TCP across.

With ranks on several nodes, L ranks each (see :func:`~.layout.node_layout`), the
*lane* of a rank is its index j among its node's ranks, and the ranks of lane j (one per
node) form a cross-node ring. Every algorithm below moves each byte across nodes once
per phase, on all L lanes at once, and does the rest inside the nodes:

* all_reduce: reduce-scatter inside each node (local rank j ends with the node's sum of
  segment j), an all_reduce of segment j over lane j's ring, an all-gather inside the
  node. Each rank sends 2(k-1)/k of S/L across nodes (k nodes), where a flat ring sends
  2(n-1)/n of S over every link, the cross-node links included.
* reduce_scatter: one reduce-scatter inside each node per destination node (local rank
  j receives the node's sum of the pieces of lane j), then a reduce-scatter over lane
  j's ring.
* all_gather: an all-gather over lane j's ring (each rank gets the parts of its lane),
  then one all-gather inside each node per source node.
* broadcast: the pipelined chain, in an order that visits the root's node first and then
  each node in turn, so the chain crosses between nodes k-1 times.

Message steps: the phases inside a node use step bases spaced ``_NODE_STEP`` apart (one
per source or destination node), lane rings start at ``_LANE_STEP``; the all-gather
halves add ``GATHER_STEP`` as in the flat algorithms.
"""

from __future__ import annotations

import asyncio

import numpy as np

from shardwire.worker.collectives import ring
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.layout import bounds
from shardwire.worker.collectives.ops import ReduceOp
from shardwire.worker.collectives.plan import GATHER_STEP

_NODE_STEP = 1 << 20
_LANE_STEP = 1 << 28

Layout = list[list[int]]


def _place(c: Call, layout: Layout) -> tuple[int, int]:
    """(node index, lane) of this rank."""
    for node, ranks in enumerate(layout):
        if c.rank in ranks:
            return node, ranks.index(c.rank)
    raise ValueError(f"group rank {c.rank} is in no node of {layout}")


def _lane(c: Call, layout: Layout, lane: int) -> Call:
    return c.sub([ranks[lane] for ranks in layout], _LANE_STEP)


async def all_reduce(c: Call, buf: np.ndarray, op: ReduceOp, layout: Layout) -> None:
    """In-place all-reduce of ``buf`` (flat)."""
    node, lane = _place(c, layout)
    local = c.sub(layout[node])
    segs = bounds(buf.size, len(layout[node]))
    gathered = ring.post_all_gather(local, buf, segs, base_step=GATHER_STEP)
    await ring.reduce_scatter(local, buf, buf, segs, op)
    a, b = segs[lane]
    await ring.all_reduce(_lane(c, layout, lane), buf[a:b], op, count=c.size)
    await ring.all_gather(local, buf, segs, base_step=GATHER_STEP, receives=gathered)


async def reduce_scatter(
    c: Call,
    src: np.ndarray,
    acc: np.ndarray,
    segs: list[tuple[int, int]],
    op: ReduceOp,
    *,
    layout: Layout,
) -> None:
    """Afterwards ``acc[segs[rank]]`` is segment ``rank`` reduced over the group."""
    node, lane = _place(c, layout)

    async def inside(dest: int) -> None:
        local = c.sub(layout[node], (dest + 1) * _NODE_STEP)
        await ring.reduce_scatter(local, src, acc, [segs[r] for r in layout[dest]], op)

    await asyncio.gather(*(inside(dest) for dest in range(len(layout))))
    across = _lane(c, layout, lane)
    await ring.reduce_scatter(across, acc, acc, [segs[ranks[lane]] for ranks in layout], op)


async def all_gather(c: Call, buf: np.ndarray, segs: list[tuple[int, int]], layout: Layout) -> None:
    """Afterwards every ``buf[segs[r]]`` holds rank r's part (each rank filled its own)."""
    node, lane = _place(c, layout)
    await ring.all_gather(_lane(c, layout, lane), buf, [segs[ranks[lane]] for ranks in layout])

    async def inside(source: int) -> None:
        local = c.sub(layout[node], (source + 1) * _NODE_STEP)
        await ring.all_gather(local, buf, [segs[r] for r in layout[source]])

    await asyncio.gather(*(inside(source) for source in range(len(layout))))


async def broadcast(c: Call, buf: np.ndarray, root: int, layout: Layout) -> None:
    """Root's ``buf`` to every rank along a chain that visits one node after another."""
    first = next(i for i, ranks in enumerate(layout) if root in ranks)
    order: list[int] = []
    for i in range(len(layout)):
        ranks = layout[(first + i) % len(layout)]
        if i == 0:  # the root's node, starting at the root
            at = ranks.index(root)
            ranks = ranks[at:] + ranks[:at]
        order += ranks
    await ring.broadcast_chain(c.sub(order), buf, 0)
