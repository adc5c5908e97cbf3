"""Latency-optimal algorithms for small payloads.

* all_reduce: recursive doubling (log2 n rounds). For n not a power of two the first
  2*rem ranks fold pairwise into one (rem = n - 2^k), the 2^k survivors double, and the
  result is handed back (Thakur, Rabenseifner & Gropp, 2005).
* scan: recursive doubling by distance (to r + 2^k, from r - 2^k), ceil(log2 n) rounds.
* all_gather, reduce_scatter, gather, scatter, all_to_all: direct exchange, one round.
* broadcast, reduce, and gather and scatter in groups of more than 8: binomial trees
  rooted anywhere (a rank talks to log2 n others).
* barrier: ceil(log2 n) rounds of empty messages: pairwise exchanges with r ^ 2^k when n
  is a power of two, dissemination (to r + 2^k, from r - 2^k) otherwise.

The trees number ranks from the root: by XOR with it when n is a power of two, by
rotation otherwise. With XOR a rank's tree peers are the ranks r ^ 2^k whatever the
root, the same log2 n peers recursive doubling, the all_to_all and the barrier use, so
a rank that runs them all holds log2 n connections, not 2 log2 n.

Reductions always combine the lower ranks' part first, so every rank and every run
computes the same expression.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import numpy as np

from shardwire.worker.backends.call import Call
from shardwire.worker.kernels.reduce import ReduceOp
from shardwire.worker.kernels.segments import largest_power_of_two, paired

_EMPTY = np.zeros(0, np.uint8)


def _rooted(n: int, r: int, root: int) -> tuple[int, Callable[[int], int]]:
    """This rank's number in a tree rooted at ``root``, and the rank of a tree number."""
    if paired(n):
        return r ^ root, lambda v: v ^ root
    return (r - root) % n, lambda v: (v + root) % n


def _real(virtual: int, rem: int) -> int:
    return 2 * virtual if virtual < rem else virtual + rem


async def all_reduce_doubling(c: Call, buf: np.ndarray, op: ReduceOp) -> None:
    """In-place all-reduce of ``buf``."""
    n, r = c.size, c.rank
    p = largest_power_of_two(n)
    rem = n - p
    scratch = c.scratch(buf.size, buf.dtype)
    last = p.bit_length()  # step numbers: 0 fold, 1..log2(p) rounds, last unfold
    if r < 2 * rem:
        if r % 2:
            await c.send(r - 1, buf, 0)
            await c.recv(r - 1, last, out=buf)
            return
        await c.recv(r + 1, 0, out=scratch)
        c.combine(op, buf, scratch, out=buf)
        virtual = r // 2
    else:
        virtual = r - rem
    mask, step = 1, 1
    while mask < p:
        partner_v = virtual ^ mask
        partner = _real(partner_v, rem)
        receive = c.irecv(partner, step, out=scratch)
        await c.send(partner, buf, step)
        await receive.wait()
        if virtual < partner_v:
            c.combine(op, buf, scratch, out=buf)
        else:
            c.combine(op, scratch, buf, out=buf)
        mask <<= 1
        step += 1
    if r < 2 * rem:
        await c.send(r + 1, buf, last)


async def scan_doubling(c: Call, buf: np.ndarray, op: ReduceOp) -> None:
    """In-place inclusive prefix reduction of ``buf``: rank r ends with ranks 0..r's
    combined (AVG still to be divided). In round k (distance d = 2^k) a rank holds ranks
    r-d+1..r combined: it sends that to r + d and combines, the lower ranks' first, what
    r - d holds (Hillis and Steele): ceil(log2 n) rounds."""
    n, r = c.size, c.rank
    scratch = c.scratch(buf.size, buf.dtype)
    distance, step = 1, 0
    while distance < n:
        below, above = r - distance, r + distance
        receive = c.irecv(below, step, out=scratch) if below >= 0 else None
        if above < n:
            await c.send(above, buf, step)
        if receive is not None:
            await receive.wait()
            c.combine(op, scratch, buf, out=buf)
        distance <<= 1
        step += 1


async def exchange(
    c: Call,
    send_to: Mapping[int, np.ndarray],
    recv_from: Mapping[int, np.ndarray | None],
    *,
    step: int = 0,
) -> dict[int, np.ndarray]:
    """One round: send ``send_to[p]`` to each listed peer, and receive from each peer in
    ``recv_from`` (into the given array, or a new one for None). Returns what arrived."""
    receives = {p: c.irecv(p, step, out=out) for p, out in recv_from.items() if p != c.rank}
    await asyncio.gather(*(c.send(p, a, step) for p, a in send_to.items() if p != c.rank))
    return {p: await receive.wait() for p, receive in receives.items()}


async def broadcast_tree(c: Call, buf: np.ndarray | None, root: int) -> np.ndarray:
    """Binomial-tree broadcast; non-roots may pass ``None`` to receive any shape."""
    n = c.size
    v, real = _rooted(n, c.rank, root)
    mask = 1
    while mask < n:  # receive from the parent: v with its lowest set bit cleared
        if v & mask:
            buf = await c.recv(real(v - mask), 0, out=buf)
            break
        mask <<= 1
    assert buf is not None
    mask >>= 1
    while mask:
        if v + mask < n:
            await c.send(real(v + mask), buf, 0)
        mask >>= 1
    return buf


async def reduce_tree(c: Call, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    """Binomial-tree reduce into ``buf`` on ``root`` (``buf`` is overwritten elsewhere)."""
    n = c.size
    v, real = _rooted(n, c.rank, root)
    scratch = c.scratch(buf.size, buf.dtype)
    mask = 1
    while mask < n:
        if v & mask:
            await c.send(real(v - mask), buf, 0)
            return
        if v + mask < n:
            await c.recv(real(v + mask), 0, out=scratch)
            c.combine(op, buf, scratch, out=buf)  # own (lower virtual ranks) part first
        mask <<= 1


async def barrier(c: Call) -> None:
    n, r = c.size, c.rank
    xor = paired(n)
    distance, step = 1, 0
    while distance < n:
        to, frm = (r ^ distance,) * 2 if xor else ((r + distance) % n, (r - distance) % n)
        receive = c.irecv(frm, step)
        await c.send(to, _EMPTY, step)
        await receive.wait()
        distance <<= 1
        step += 1


def _subtree(v: int, n: int) -> int:
    """The end of the binomial subtree of virtual rank ``v`` (it covers ``v .. end-1``)."""
    span = v & -v if v else 1 << max(0, n - 1).bit_length()
    return min(v + span, n)


async def gather_tree(c: Call, mine: np.ndarray, counts: list[int], root: int) -> np.ndarray | None:
    """Binomial-tree gather of flat ``mine`` (``counts[p]`` elements from rank p): on
    ``root`` every rank's elements in rank order, elsewhere None. A rank receives its
    subtree's parts, one message per child, and passes them up as one: log2 n peers."""
    n, r = c.size, c.rank
    v, real = _rooted(n, r, root)
    end = _subtree(v, n)
    order = [real(u) for u in range(v, end)]  # this subtree's ranks, virtual order
    starts = np.cumsum([0] + [counts[p] for p in order])
    stage = c.scratch(int(starts[-1]), mine.dtype)
    np.copyto(stage[: counts[r]], mine)
    mask = 1
    while mask < n:
        if v & mask:
            await c.send(real(v - mask), stage, 0)
            return None
        child = v + mask
        if child < n:  # its subtree is child .. _subtree(child)-1, right after ours so far
            a, b = starts[child - v], starts[_subtree(child, n) - v]
            await c.recv(real(child), 0, out=stage[a:b])
        mask <<= 1
    out = np.empty(sum(counts), mine.dtype)
    at = np.cumsum([0, *counts])
    for u, p in enumerate(order):  # from virtual order (root first) to rank order
        out[at[p] : at[p + 1]] = stage[starts[u] : starts[u + 1]]
    return out


async def gather_blobs_tree(c: Call, mine: np.ndarray, root: int) -> list[np.ndarray] | None:
    """Binomial-tree gather of byte strings of any lengths (``mine``: uint8): on
    ``root`` every rank's, by rank; elsewhere None. A rank passes its subtree's up as
    their lengths, then their bytes: log2 n peers, and nobody needs the sizes first."""
    n = c.size
    v, real = _rooted(n, c.rank, root)
    lengths, blobs = [mine.size], [mine]  # this subtree's, in virtual order
    mask = 1
    while mask < n:
        if v & mask:
            parent = real(v - mask)
            await c.send(parent, np.array(lengths, np.int64), 0)
            await c.send(parent, np.concatenate(blobs), 1)
            return None
        if v + mask < n:
            child = real(v + mask)
            sizes = await c.recv(child, 0)
            data = await c.recv(child, 1)
            ends = np.cumsum(sizes)
            blobs += [data[e - k : e] for k, e in zip(sizes.tolist(), ends.tolist(), strict=True)]
            lengths += sizes.tolist()
        mask <<= 1
    at = {real(u): u for u in range(n)}
    return [blobs[at[p]] for p in range(n)]  # virtual order -> rank order


async def scatter_tree(c: Call, chunks: list[np.ndarray] | None, root: int) -> np.ndarray:
    """Binomial-tree scatter: ``root`` passes ``chunks`` (one per rank, rows of the same
    row shape); every rank returns its own. A rank gets its subtree's rows from its
    parent (their counts first) and passes each child its part: log2 n peers."""
    n = c.size
    v, real = _rooted(n, c.rank, root)
    end = _subtree(v, n)
    if v == 0:
        assert chunks is not None
        order = [chunks[real(u)] for u in range(n)]
        rows = np.array([len(x) for x in order], np.int64)
        data = np.concatenate(order) if n > 1 else order[0]
    else:
        parent = real(v - (v & -v))
        rows = await c.recv(parent, 0)
        data = await c.recv(parent, 1)
    starts = np.cumsum([0, *rows.tolist()])
    mask = (end - v - 1).bit_length()
    while mask:
        mask -= 1
        child = v + (1 << mask)
        if child < end:
            stop = _subtree(child, n)
            a, b = child - v, stop - v
            await c.send(real(child), rows[a:b], 0)
            await c.send(real(child), data[starts[a] : starts[b]], 1)
    return data[: starts[1]].copy()  # not a view holding the subtree's rows
