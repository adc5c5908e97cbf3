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
* When n is a power of two, all_gather is recursive doubling and reduce_scatter
  recursive halving instead: every round is one exchange with the rank r ^ d of a run
  of d blocks aligned to d (contiguous in the buffer), the same bytes in as many rounds,
  with log2 n peers instead of 2 log2 n.
* all_to_all (Bruck's index algorithm): a rank's block for rank r + j sits in slot j;
  in the round of distance d every rank sends the slots whose index has bit d set to
  the rank d above and takes the same slots from the rank d below, so a block moves j
  ranks forward in all and ends in slot j of its destination, which then holds the
  block from rank r - j. Each block travels about log2(n)/2 hops, so this is for small
  blocks; a round's slots go as their sizes, then their rows in one message. When n is
  a power of two the same runs with r ^ j in place of r + j: the round of distance d is
  then one exchange with the rank r ^ d, and a rank talks to log2 n ranks, not 2 log2 n.

Blocks stay where they belong in the flat buffer; a cyclic run of blocks is at most two
contiguous ranges of it, sent as two messages (the second often empty), so nothing is
packed or unpacked. Every block's reduction happens on one rank and is then copied,
so all ranks hold bit-identical results.
"""

from __future__ import annotations

import numpy as np

from shardwire.worker.backends.call import Call
from shardwire.worker.kernels.reduce import ReduceOp, finish
from shardwire.worker.kernels.segments import bounds, paired

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


def _span(segs: Segs, first: int, count: int) -> tuple[int, int]:
    """The buffer range of blocks ``first .. first+count-1`` (no wrap)."""
    return segs[first][0], segs[first + count - 1][1]


async def all_gather(c: Call, buf: np.ndarray, segs: Segs, *, base_step: int = _AG_STEP) -> None:
    """In-place all-gather: rank r's block ``buf[segs[r]]`` is filled in on every rank."""
    n, r = c.size, c.rank
    if paired(n):  # recursive doubling: the held blocks are r's aligned run of d
        d, step = 1, base_step
        while d < n:
            p = r ^ d
            ma, mb = _span(segs, r & -d, d)
            pa, pb = _span(segs, p & -d, d)
            await _swap(c, p, [buf[ma:mb]], p, [buf[pa:pb]], step=step)
            d, step = d << 1, step + 2
        return
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
    if paired(n):  # recursive halving: keep the aligned half that holds r's block
        d, step = n >> 1, 0
        while d:
            p = r ^ d
            ka, kb = _span(segs, r & -d, d)
            ga, gb = _span(segs, p & -d, d)
            part = c.scratch(kb - ka, acc.dtype)
            await _swap(c, p, [acc[ga:gb]], p, [part], step=step)
            lower = (part, acc[ka:kb]) if p < r else (acc[ka:kb], part)  # lower rank's first
            c.combine(op, *lower, out=acc[ka:kb])
            d, step = d >> 1, step + 2
        return
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


def _pick(buf: np.ndarray, sizes: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The blocks ``buf`` holds back to back (``sizes``), one after another in ``order``,
    gathered by one index array (no Python loop over the blocks)."""
    starts, sizes = (np.cumsum(sizes) - sizes)[order], sizes[order]
    ends = np.cumsum(sizes)
    shift = np.repeat(starts - (ends - sizes), sizes)
    return buf[np.arange(int(ends[-1]) if len(ends) else 0) + shift]


async def all_to_all(c: Call, data: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The next ``counts[p]`` elements of ``data`` (flat) to rank p; returns what each
    rank sent this one, flat in rank order, in ceil(log2 n) rounds with the ranks at
    distances ±2^k only (r ^ 2^k when n is a power of two). The slots live in one
    buffer with their sizes beside it, so a round is a few array operations whatever n."""
    n, r = c.size, c.rank
    xor = paired(n)
    j = np.arange(n)
    # slot j: for rank r + j (r ^ j when paired), so each block leaves by the bits of j
    dest = r ^ j if xor else (r + j) % n
    dtype = data.dtype
    sizes = counts[dest]  # a copy: updated as slots arrive
    buf = _pick(data, counts, dest)
    d, step = 1, 0
    while d < n:
        to, frm = (r ^ d,) * 2 if xor else ((r + d) % n, (r - d) % n)
        moving = (j & d) != 0
        leaving = np.repeat(moving, sizes)  # element by element
        got_sizes = c.irecv(frm, step, out=np.empty(int(moving.sum()), np.int64))
        await c.send(to, sizes[moving], step)
        arrived = await got_sizes.wait()
        rows = c.irecv(frm, step + 1, out=np.empty(int(arrived.sum()), dtype))
        await c.send(to, buf[leaving], step + 1)
        sizes[moving] = arrived
        landing = np.repeat(moving, sizes)
        held = np.empty(int(sizes.sum()), dtype)
        held[~landing] = buf[~leaving]
        held[landing] = await rows.wait()
        buf, d, step = held, d << 1, step + 2
    # slot j holds the block of rank r - j (r ^ j when paired)
    source = r ^ j if xor else (r - j) % n
    return _pick(buf, sizes, source)
