"""Bandwidth-optimal ring algorithms with chunk pipelining.

Theory of operation
-------------------
The flat buffer is cut into one *segment* per rank. Reduce-scatter takes n-1 steps: at
step s rank r sends segment (r-s-1) mod n to its right neighbour and receives segment
(r-s-2) mod n from its left one, combining it with its own contribution; afterwards rank
r holds segment r reduced over all ranks. All-gather then circulates the finished
segments for another n-1 steps. Every rank sends and receives (n-1)/n of the buffer per
phase, which is optimal (Patarasuk & Yuan, 2009).

Each segment is further cut into ``depth`` chunks, and each chunk index runs the whole
ring as its own *lane* (a coroutine): while one lane waits for bytes, another reduces,
so copying, reducing and the wire overlap. Receives are posted before the matching send
goes out (all of a phase's receives at once), so payloads land directly in their
destination. The broadcast is a pipelined
chain in the same spirit.
"""

from __future__ import annotations

import asyncio

import numpy as np

from shardwire.worker.backends.algorithms import GATHER_STEP
from shardwire.worker.backends.call import Call
from shardwire.worker.kernels.reduce import ReduceOp, finish
from shardwire.worker.kernels.segments import bounds, pipeline_depth, sub
from shardwire.worker.transport.base import Fold, Receive

# Chunk size and lane count, from `shardwire bench collectives` on 2 cores over loopback:
# 1 MiB chunks and up to 4 lanes gave the best 16-256 MiB all_reduce (smaller chunks
# cost Python overhead per message, more lanes just queue behind each other).
CHUNK_BYTES = 1 << 20
MAX_LANES = 4
# The chain broadcast needs more, smaller pieces: its latency is (n - 1 + pieces) hops.
CHAIN_PIECES = 64
# Reducing straight out of shared memory (a receive's fold) is used when the reduction
# is in place (acc is src: all_reduce). Measured on 2 cores, 2
# ranks, float32, same run: in place, all_reduce 16 MiB 3.7 -> 4.3 GB/s and 64 MiB
# 3.2 -> 4.2-4.5 GB/s; out of place (reduce_scatter into a scratch buffer) it was slower
# (16 MiB 2.2 -> 1.7 GB/s), although a fold does less memory traffic than copy-then-add
# (1.0 vs 1.5 ms per 8 MiB in one process): the slot's credit goes back only after the
# fold, and the out-of-place ring stalls on it.


def _lanes(segs: list[tuple[int, int]], itemsize: int) -> int:
    widest = max(b - a for a, b in segs) * itemsize
    return pipeline_depth(widest, chunk_bytes=CHUNK_BYTES, max_depth=MAX_LANES)


def _folder(c: Call, op: ReduceOp, mine: np.ndarray, acc: np.ndarray) -> Fold:
    """``acc = incoming (op) mine``, piece by piece as the incoming bytes arrive (the
    left neighbour's partial sum comes first, as everywhere: bit-identical results)."""

    def fold(piece: np.ndarray, at: int) -> None:
        end = at + piece.size
        c.combine(op, piece, mine[at:end], out=acc[at:end])

    return fold


async def reduce_scatter(
    c: Call,
    src: np.ndarray,
    acc: np.ndarray,
    segs: list[tuple[int, int]],
    op: ReduceOp,
    *,
    base_step: int = 0,
) -> None:
    """Afterwards ``acc[segs[rank]]`` is segment ``rank`` reduced over the group.

    ``src`` is this rank's contribution (flat); ``acc`` (flat, may be ``src``) receives
    the partial reductions. Every receive is posted up front into its own region of one
    scratch buffer (each step receives a different segment), so no payload waits.
    """
    n, r = c.size, c.rank
    right, left = (r + 1) % n, (r - 1) % n
    depth = _lanes(segs, src.itemsize)
    incoming = c.scratch(src.size, src.dtype)
    folding = acc is src  # see FOLD_IN_PLACE
    receives = {}
    for s in range(n - 1):
        for j in range(depth):
            ra, rb = sub(segs[(r - s - 2) % n], depth, j)
            fold = _folder(c, op, src[ra:rb], acc[ra:rb]) if folding else None
            step = base_step + s * depth + j
            receives[s, j] = c.irecv(left, step, out=incoming[ra:rb], fold=fold)

    async def lane(j: int) -> None:
        for s in range(n - 1):
            sa, sb = sub(segs[(r - s - 1) % n], depth, j)
            await c.send(right, (src if s == 0 else acc)[sa:sb], base_step + s * depth + j)
            await receives[s, j].wait()  # when folding, it is reduced into acc already
            if not folding:
                ra, rb = sub(segs[(r - s - 2) % n], depth, j)
                c.combine(op, incoming[ra:rb], src[ra:rb], out=acc[ra:rb])

    await asyncio.gather(*(lane(j) for j in range(depth)))


def post_all_gather(
    c: Call, buf: np.ndarray, segs: list[tuple[int, int]], *, base_step: int = 0
) -> dict[tuple[int, int], Receive]:
    """Post every all-gather receive straight into ``buf``.

    Safe before a reduce-scatter on the same buffer finishes: the finished value of a
    segment cannot exist anywhere before this rank has sent its own part of it.
    """
    n, r = c.size, c.rank
    depth = _lanes(segs, buf.itemsize)
    receives = {}
    for s in range(n - 1):
        for j in range(depth):
            ra, rb = sub(segs[(r - s - 1) % n], depth, j)
            receives[s, j] = c.irecv((r - 1) % n, base_step + s * depth + j, out=buf[ra:rb])
    return receives


async def all_gather(
    c: Call,
    buf: np.ndarray,
    segs: list[tuple[int, int]],
    *,
    base_step: int = 0,
    receives: dict[tuple[int, int], Receive] | None = None,
) -> None:
    """Circulate segments: afterwards every segment of ``buf`` (flat) is filled."""
    n, r = c.size, c.rank
    depth = _lanes(segs, buf.itemsize)
    if receives is None:
        receives = post_all_gather(c, buf, segs, base_step=base_step)

    async def lane(j: int) -> None:
        for s in range(n - 1):
            sa, sb = sub(segs[(r - s) % n], depth, j)
            await c.send((r + 1) % n, buf[sa:sb], base_step + s * depth + j)
            await receives[s, j].wait()

    await asyncio.gather(*(lane(j) for j in range(depth)))


async def all_reduce(c: Call, buf: np.ndarray, op: ReduceOp, *, count: int | None = None) -> None:
    """In-place all-reduce of ``buf`` (flat): reduce-scatter, then all-gather. AVG divides
    by ``count`` ranks (default: the call's)."""
    segs = bounds(buf.size, c.size)
    gathered = post_all_gather(c, buf, segs, base_step=GATHER_STEP)
    await reduce_scatter(c, buf, buf, segs, op)
    a, b = segs[c.rank]
    finish(op, buf[a:b], c.size if count is None else count)
    await all_gather(c, buf, segs, base_step=GATHER_STEP, receives=gathered)


async def broadcast_chain(c: Call, buf: np.ndarray, root: int) -> None:
    """Pipelined chain root -> root+1 -> ...: each piece is forwarded as it arrives."""
    n, r = c.size, c.rank
    position = (r - root) % n
    prev, nxt = (r - 1) % n, (r + 1) % n
    # Pieces only pay off with a hop to pipeline behind: two ranks send it whole.
    count = 1 if n == 2 else max(1, min(CHAIN_PIECES, buf.nbytes // (256 * 1024)))
    pieces = bounds(len(buf), count)
    receives = (
        [c.irecv(prev, j, out=buf[a:b]) for j, (a, b) in enumerate(pieces)] if position else []
    )
    for j, (a, b) in enumerate(pieces):
        if position:
            await receives[j].wait()
        if position < n - 1:
            await c.send(nxt, buf[a:b], j)
