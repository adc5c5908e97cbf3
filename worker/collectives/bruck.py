"""Logarithmic algorithms for many ranks: each rank talks to the ranks at distances
±2^k only, ceil(log2 n) rounds, for any n.

* all_gather (Bruck, Kumar, Ho, Kipnis & Upfal, 1997): after the round of distance d a
  rank holds the blocks of the 2d ranks from itself on (cyclically); in it a rank sends
  the blocks it holds to the rank d below and receives as many from the rank d above.
* reduce_scatter: the same exchange transposed, distances halving. A rank starts with
  partial sums for all n blocks, counted cyclically from its own; in the round of
  distance d it passes the partial sums of the blocks from offset d on to the rank d
  above (for which they start at offset 0), keeps the first d, and adds in the ones
  the rank d below passes it. The first distance is the largest power of two below n,
  then every round halves the blocks a rank still holds, down to its own.
* all_reduce (Rabenseifner's shape): that reduce_scatter over n even slices of the
  buffer, then that all_gather. Twice the bytes of the buffer leave each rank, as in a
  ring, but in 2·ceil(log2 n) messages each way instead of 2(n - 1).
* all_to_all (Bruck's index algorithm): a rank's block for rank r + j sits in slot j;
  in the round of distance d every rank sends the slots whose index has bit d set to
  the rank d above and takes the same slots from the rank d below, so a block moves j
  ranks forward in all and ends in slot j of its destination, which then holds the
  block from rank r - j. Each block travels about log2(n)/2 hops, so this is for small
  blocks; a round's slots go as their sizes, then their rows in one message.

Blocks stay where they belong in the flat buffer; a cyclic run of blocks is at most two
contiguous ranges of it, sent as two messages (the second often empty), so nothing is
packed or unpacked. Every block's reduction happens on one rank and is then copied,
so all ranks hold bit-identical results.
"""

from __future__ import annotations

import numpy as np

from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.layout import bounds, offsets
from shardwire.worker.collectives.ops import ReduceOp, finish

_AG_STEP = 1 << 20  # all_gather's message steps from here (reduce_scatter's from 0)

Segs = list[tuple[int, int]]


def _ranges(segs: Segs, first: int, count: int) -> list[tuple[int, int]]:
    """The buffer ranges of blocks ``first .. first+count-1`` (mod n): always two (the
    second empty unless the run wraps)."""
    n = len(segs)
    first %= n
    if count <= 0:
        return [(0, 0), (0, 0)]
    if first + count <= n:
        return [(segs[first][0], segs[first + count - 1][1]), (0, 0)]
    wrapped = first + count - n
    return [(segs[first][0], segs[n - 1][1]), (segs[0][0], segs[wrapped - 1][1])]


async def _swap(
    c: Call, to: int, sending: list[np.ndarray], frm: int, receiving: list[np.ndarray], *, step: int
) -> None:
    """Send ``sending`` to ``to`` while receiving into ``receiving`` from ``frm``."""
    receives = [c.irecv(frm, step + i, out=out) for i, out in enumerate(receiving)]
    for i, part in enumerate(sending):
        await c.send(to, part, step + i)
    for receive in receives:
        await receive.wait()


async def all_gather(c: Call, buf: np.ndarray, segs: Segs, *, base_step: int = _AG_STEP) -> None:
    """In-place all-gather: rank r's block ``buf[segs[r]]`` is filled in on every rank."""
    n, r = c.size, c.rank
    d, step = 1, base_step
    while d < n:
        count = min(d, n - d)
        outgoing = [buf[a:b] for a, b in _ranges(segs, r, count)]
        incoming = [buf[a:b] for a, b in _ranges(segs, r + d, count)]
        await _swap(c, (r - d) % n, outgoing, (r + d) % n, incoming, step=step)
        d <<= 1
        step += 2


async def reduce_scatter(
    c: Call, src: np.ndarray, acc: np.ndarray, segs: Segs, op: ReduceOp
) -> None:
    """Reduce ``src`` over the group; rank r's reduced block ends in ``acc[segs[r]]``
    (``acc`` may be ``src``; the rest of ``acc`` is scratch afterwards)."""
    n, r = c.size, c.rank
    if acc is not src:
        np.copyto(acc, src)
    held, d, step = n, 1, 0
    while d * 2 < n:
        d <<= 1
    while held > 1:
        count = held - d  # blocks at offsets d .. held-1 go up; as many come from below
        ranges = _ranges(segs, r, count)
        scratch = [c.scratch(b - a, acc.dtype) for a, b in ranges]
        outgoing = [acc[a:b] for a, b in _ranges(segs, r + d, count)]
        await _swap(c, (r + d) % n, outgoing, (r - d) % n, scratch, step=step)
        for (a, b), part in zip(ranges, scratch, strict=True):
            # the part from below first: one fixed expression per block on every run
            c.combine(op, part, acc[a:b], out=acc[a:b])
        held, d, step = d, d >> 1, step + 2


async def all_reduce(c: Call, buf: np.ndarray, op: ReduceOp) -> None:
    """In-place all-reduce of ``buf`` (flat): the reduce_scatter above over n even
    slices, then the all_gather."""
    segs = bounds(buf.size, c.size)
    await reduce_scatter(c, buf, buf, segs, op)
    a, b = segs[c.rank]
    finish(op, buf[a:b], c.size)
    await all_gather(c, buf, segs)


async def all_to_all(c: Call, parts: list[np.ndarray], dtype: np.dtype) -> list[np.ndarray]:
    """``parts[p]`` (flat, of ``dtype``) to rank p; returns what each rank sent this one,
    by rank, in ceil(log2 n) rounds with the ranks at distances ±2^k only."""
    n, r = c.size, c.rank
    slots = [parts[(r + j) % n] for j in range(n)]  # slot j: for rank r + j
    d, step = 1, 0
    while d < n:
        moving = [j for j in range(n) if j & d]
        sizes = np.array([slots[j].size for j in moving], np.int64)
        got_sizes = c.irecv((r - d) % n, step, out=np.empty(len(moving), np.int64))
        await c.send((r + d) % n, sizes, step)
        arrived = await got_sizes.wait()
        rows = c.irecv((r - d) % n, step + 1, out=np.empty(int(arrived.sum()), dtype))
        await c.send((r + d) % n, np.concatenate([slots[j] for j in moving]), step + 1)
        flat = await rows.wait()
        for j, (a, b) in zip(moving, offsets(arrived.tolist()), strict=True):
            slots[j] = flat[a:b]
        d, step = d << 1, step + 2
    return [slots[(r - p) % n] for p in range(n)]  # slot j holds rank r - j's block
