"""Collectives on the node arena, as programs that yield what they wait for.

Theory of operation
-------------------
Each local rank has a slot in the region, used as two halves. Work goes in *chunks* of
at most a half; chunks are numbered by a clock every local rank advances alike (the
calls of a group are made in the same order everywhere), and chunk g uses half g % 2. A
chunk is::

    wait until every other rank has *released* chunk g-2 (read what it needed from it),
    write your part into your half g % 2, sign it (call number, signature CRC),
    publish your *ready* value (the next tick of the shared clock),
    wait for the ready values you need, check the signatures of what you will read,
    read (copy out or reduce, in rank order, straight from the other halves),
    publish *released* = g.

So a half is only overwritten once everyone is done with it, two chunks later, and a
rank never waits for a frame or the event loop: it waits for words in shared memory
(``board``). Nothing read from another rank's row decides an offset: every offset comes
from this rank's own call arguments and the region's geometry.

* all_gather: one chunk per slot half of the widest part; each rank copies every other
  part straight into the caller's output. Parts of ``READ_BYTES`` or more, where ranks
  may read each other's memory (``peerread``), skip the region: each rank publishes
  where its input lies, the others copy it from there (one copy per reader, not two),
  and it returns once all released. A rank that leaves early has poisoned the arena
  first (its group does, on any error): readers check the abort word after reading.
* reduce_scatter: a rank writes, for every destination, its piece of that destination's
  segment; rank r reduces piece r of every half, in rank order, into its output.
* all_reduce: small payloads (``DIRECT_BYTES``) are reduced whole by every rank (one
  synchronisation, k-fold reads); larger ones as DeepSpeed's CPU shared-memory
  all-reduce: each rank reduces its 1/k slice from every half into its own half,
  publishes, and copies all slices out (two synchronisations, the least memory traffic).
* scan: every rank writes its part; rank r reduces those of ranks 0..r (it waits for
  no rank above it).
* broadcast: the root writes, the others copy out; barrier: a chunk with no data.

Reductions combine rank 0's part with rank 1's, then rank 2's, ...: every rank and every
run computes the same expression (bit-identical results).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any, NamedTuple

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.arena import peerread
from shardwire.worker.arena.board import DONE, READY, Board
from shardwire.worker.kernels.reduce import ReduceOp, finish
from shardwire.worker.kernels.segments import bounds
from shardwire.worker.observe.split import Split, reduce_with

# all_reduce payloads up to this size are reduced whole by every rank (one sync, not 2).
DIRECT_BYTES = 64 * 1024
# all_gather parts from this size are read from their owners' memory, where ranks may.
READ_BYTES = 256 * 1024
_WHERE = np.dtype(np.uint64)  # an all_gather's input address and size, in its half
_HEADS = 64  # sliced views kept (HalfViews.heads)


class Need(NamedTuple):
    """A program waits until ``word`` of every rank in ``ranks`` reached ``target``."""

    word: int
    ranks: Sequence[int]
    target: int


Program = Generator[Need, None, None]


class Mismatch(Exception):
    """Local rank ``rank`` wrote a different call into the half this rank reads."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"local rank {rank} is in a different call")
        self.rank = rank


class Clock:
    """The shared logical clocks: publish ticks and chunk numbers."""

    __slots__ = ("chunk", "tick")

    def __init__(self) -> None:
        self.tick = 0
        self.chunk = 0


class Context:
    """What a program needs: this rank's board, the halves as arrays, the clocks."""

    def __init__(self, board: Board, halves: HalfViews, clock: Clock, signature: int) -> None:
        self.board = board
        self.pids: list[int] | None = None  # local ranks' process ids, if they may read
        self.halves = halves
        self.clock = clock
        self.signature = signature
        self.k, self.me, self.others = board.k, board.me, board.others
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self.split: Split | None = None  # the running call's, when the job is traced
        self.sent = 0  # bytes this rank wrote for the others (its contributions)
        self.received = 0  # bytes this rank read from the others' halves (or memory)
        self.read = 0  # of those, bytes read from the others' memory (``peerread``)

    def next_chunk(self) -> tuple[int, int]:
        self.clock.chunk += 1
        g = self.clock.chunk
        return g, g & 1

    def unmet(self, word: int, ranks: Sequence[int], target: int) -> Need | None:
        """None if every rank's ``word`` reached ``target`` already (the program goes on
        without yielding to the engine), else what to wait for."""
        if self.board.lagging(word, ranks, target) < 0:
            return None
        return Need(word, ranks, target)

    def writable(self, g: int) -> Need | None:
        """What to wait for before writing chunk ``g`` (None: nothing)."""
        return self.unmet(DONE, self.others, g - 2)

    def tick(self) -> int:
        self.clock.tick += 1
        return self.clock.tick

    def written(self, half: int) -> int:
        """Sign ``half`` and publish: returns the tick the readers wait for."""
        self.board.sign(half, self.signature)
        tick = self.tick()
        self.board.publish(READY, tick)
        return tick

    def check(self, ranks: Sequence[int], half: int) -> None:
        r = self.board.unsigned(ranks, half, self.signature)
        if r >= 0:
            raise Mismatch(r)

    def release(self, g: int) -> None:
        self.board.publish(DONE, g)

    def half(self, rank: int, which: int, dtype: np.dtype) -> np.ndarray:
        return self.halves.get(dtype)[rank][which]

    def scratch(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A private buffer of ``count`` elements (one per dtype, reused: programs run
        one after another)."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < count:
            buf = self._scratch[dtype] = np.empty(max(count, 1024), dtype)
        return buf[:count]


class HalfViews:
    """The halves of every slot as flat arrays of a dtype (made once per dtype)."""

    def __init__(self, buffer: Any, offsets: list[list[int]], half_bytes: int):
        self._buffer = buffer
        self._offsets = offsets
        self.half_bytes = half_bytes
        self._views: dict[np.dtype, list[list[np.ndarray]]] = {}
        self._heads: dict[tuple[np.dtype, int, int], list[np.ndarray]] = {}

    def get(self, dtype: np.dtype) -> list[list[np.ndarray]]:
        views = self._views.get(dtype)  # keyed by the dtype itself: dtype.str costs 0.6 us
        if views is None:
            count = self.half_bytes // dtype.itemsize
            views = [
                [np.frombuffer(self._buffer, dtype, count, off) for off in pair]
                for pair in self._offsets
            ]
            self._views[dtype] = views
        return views

    def heads(self, dtype: np.dtype, which: int, count: int) -> list[np.ndarray]:
        """The first ``count`` elements of every rank's half ``which``, by rank (kept
        for the few shapes a job repeats: slicing k views costs microseconds a call)."""
        key = (dtype, which, count)
        views = self._heads.get(key)
        if views is None:
            if len(self._heads) >= _HEADS:
                self._heads.clear()
            views = self._heads[key] = [pair[which][:count] for pair in self.get(dtype)]
        return views

    def elements(self, dtype: np.dtype) -> int:
        return self.half_bytes // dtype.itemsize

    def clear(self) -> None:
        self._views.clear()
        self._heads.clear()


def _reduce(ctx: Context, op: ReduceOp, sources: list[np.ndarray], out: np.ndarray) -> None:
    """``out = sources[0] (op) sources[1] (op) ...``, in that order."""
    if len(sources) == 1:
        np.copyto(out, sources[0])
        return
    split = ctx.split
    reduce_with(split, op, sources[0], sources[1], out)
    for src in sources[2:]:
        reduce_with(split, op, out, src, out)


def _chunks(longest: int, per: int) -> int:
    return max(1, math.ceil(longest / per))


def all_gather(ctx: Context, parts: list[np.ndarray], src: np.ndarray) -> Program:
    """Every ``parts[r]`` (flat views of the output) gets rank r's part, ``src`` being
    this rank's. Its own part is copied out of its half, still in cache, rather than
    from ``src`` a second time: one pass over the input instead of two."""
    if ctx.pids is not None and max(p.nbytes for p in parts) >= READ_BYTES:
        yield from _all_gather_reads(ctx, parts, src, ctx.pids)
        return
    dtype = parts[ctx.me].dtype
    per = ctx.halves.elements(dtype)
    mine = parts[ctx.me]
    for i in range(_chunks(max(len(p) for p in parts), per)):
        g, h = ctx.next_chunk()
        if need := ctx.writable(g):
            yield need
        lo = i * per
        piece = src[lo : lo + per]
        own = ctx.half(ctx.me, h, dtype)[: len(piece)]
        own[:] = piece
        ctx.sent += piece.nbytes
        tick = ctx.written(h)
        mine[lo : lo + per] = own
        if need := ctx.unmet(READY, ctx.others, tick):
            yield need
        ctx.check(ctx.others, h)
        for r in ctx.others:
            dst = parts[r][lo : lo + per]
            if len(dst):
                dst[:] = ctx.half(r, h, dtype)[: len(dst)]
                ctx.received += dst.nbytes
        ctx.release(g)


def _all_gather_reads(
    ctx: Context, parts: list[np.ndarray], src: np.ndarray, pids: list[int]
) -> Program:
    """all_gather by reads of the owners' memory (see the module docstring)."""
    src = np.ascontiguousarray(src)  # the caller's input itself: calls take only contiguous ones
    g, h = ctx.next_chunk()
    if need := ctx.writable(g):
        yield need
    where = ctx.half(ctx.me, h, _WHERE)
    where[0], where[1] = src.ctypes.data, src.nbytes
    tick = ctx.written(h)
    parts[ctx.me][:] = src
    ctx.sent += src.nbytes
    if need := ctx.unmet(READY, ctx.others, tick):
        yield need
    ctx.check(ctx.others, h)
    for r in ctx.others:
        dst = parts[r]
        address, nbytes = (int(v) for v in ctx.half(r, h, _WHERE)[:2])
        if nbytes != dst.nbytes:
            raise Mismatch(r)
        if nbytes:
            try:
                peerread.read(pids[r], dst, address, rank=r)
            except peerread.ReadFailed:
                ctx.board.check_abort()  # its owner left first: that is the cause
                raise
            ctx.received += nbytes
            ctx.read += nbytes
    ctx.board.check_abort()  # an owner that left while we read may have changed its bytes
    ctx.release(g)
    if need := ctx.unmet(DONE, ctx.others, g):  # the others have read this rank's input
        yield need


def reduce_scatter(
    ctx: Context,
    src: np.ndarray,
    out: np.ndarray,
    segs: list[tuple[int, int]],
    op: ReduceOp,
    *,
    count: int,
) -> Program:
    """``out`` (flat) becomes segment ``me`` of ``src`` reduced over the local ranks."""
    k, me, dtype = ctx.k, ctx.me, src.dtype
    per = ctx.halves.elements(dtype) // k
    if per < 1:
        raise InvalidArgument(
            f"an arena half of {ctx.halves.half_bytes} bytes is too small for {k} ranks"
        )
    for i in range(_chunks(max(b - a for a, b in segs), per)):
        g, h = ctx.next_chunk()
        if need := ctx.writable(g):
            yield need
        mine = ctx.half(me, h, dtype)
        for j, (a, b) in enumerate(segs):
            s, e = a + i * per, min(b, a + (i + 1) * per)
            if e > s:
                mine[j * per : j * per + e - s] = src[s:e]
                ctx.sent += (e - s) * dtype.itemsize
        tick = ctx.written(h)
        if need := ctx.unmet(READY, ctx.others, tick):
            yield need
        ctx.check(ctx.others, h)
        a, b = segs[me]
        m = min(b, a + (i + 1) * per) - (a + i * per)
        if m > 0:
            target = out[i * per : i * per + m]
            _reduce(
                ctx, op, [ctx.half(r, h, dtype)[me * per : me * per + m] for r in range(k)], target
            )
            finish(op, target, count)
            ctx.received += (k - 1) * target.nbytes
        ctx.release(g)


def all_reduce(ctx: Context, buf: np.ndarray, op: ReduceOp, count: int) -> Program:
    """In-place all-reduce of ``buf`` (flat); AVG divides by ``count``."""
    k, me, dtype = ctx.k, ctx.me, buf.dtype
    per = ctx.halves.elements(dtype)
    whole = buf.nbytes <= DIRECT_BYTES
    for i in range(_chunks(len(buf), per)):
        g, h = ctx.next_chunk()
        if need := ctx.writable(g):
            yield need
        piece = buf if len(buf) <= per else buf[i * per : (i + 1) * per]
        m = len(piece)
        halves = ctx.halves.heads(dtype, h, m)
        halves[me][:] = piece
        ctx.sent += piece.nbytes
        tick = ctx.written(h)
        if need := ctx.unmet(READY, ctx.others, tick):
            yield need
        ctx.check(ctx.others, h)
        if whole:
            _reduce(ctx, op, halves, piece)
            finish(op, piece, count)
            ctx.received += (k - 1) * piece.nbytes
        else:
            slices = bounds(m, k)
            lo, hi = slices[me]
            # This rank's own slice is a source read only by this rank: the first
            # combination (of ranks 0 and 1) consumes it in place, so ranks 0 and 1
            # reduce straight into their half; a later rank's is read after that step,
            # so it reduces into scratch and copies the result in.
            mine = halves[me][lo:hi]
            acc = mine if me <= 1 else ctx.scratch(dtype, hi - lo)
            _reduce(ctx, op, [x[lo:hi] for x in halves], acc)
            finish(op, acc, count)
            if acc is not mine:
                mine[:] = acc
            tick = ctx.tick()
            ctx.board.publish(READY, tick)
            if need := ctx.unmet(READY, ctx.others, tick):
                yield need
            for r, (lo, hi) in enumerate(slices):
                piece[lo:hi] = halves[r][lo:hi]
            ctx.received += (k - 1) * acc.nbytes + piece.nbytes - acc.nbytes
        ctx.release(g)


def scan(ctx: Context, buf: np.ndarray, op: ReduceOp) -> Program:
    """In-place inclusive prefix reduction of ``buf`` (flat): local rank r reduces the
    halves of ranks 0..r, in rank order, and waits for no rank above it."""
    me, dtype = ctx.me, buf.dtype
    per = ctx.halves.elements(dtype)
    below = range(me)
    for i in range(_chunks(len(buf), per)):
        g, h = ctx.next_chunk()
        if need := ctx.writable(g):
            yield need
        piece = buf if len(buf) <= per else buf[i * per : (i + 1) * per]
        halves = ctx.halves.heads(dtype, h, len(piece))
        halves[me][:] = piece
        ctx.sent += piece.nbytes
        tick = ctx.written(h)
        if need := ctx.unmet(READY, below, tick):
            yield need
        ctx.check(below, h)
        _reduce(ctx, op, halves[: me + 1], piece)
        finish(op, piece, me + 1)
        ctx.received += me * piece.nbytes
        ctx.release(g)


def broadcast(ctx: Context, buf: np.ndarray, root: int) -> Program:
    """Every rank's ``buf`` (flat) becomes local rank ``root``'s."""
    per = ctx.halves.elements(buf.dtype)
    for i in range(_chunks(len(buf), per)):
        g, h = ctx.next_chunk()
        piece = buf[i * per : (i + 1) * per]
        if ctx.me == root:
            if need := ctx.writable(g):
                yield need
            ctx.half(root, h, buf.dtype)[: len(piece)] = piece
            ctx.sent += piece.nbytes
            ctx.written(h)
        else:
            tick = ctx.tick()
            if need := ctx.unmet(READY, (root,), tick):
                yield need
            ctx.check((root,), h)
            piece[:] = ctx.half(root, h, buf.dtype)[: len(piece)]
            ctx.received += piece.nbytes
        ctx.release(g)


def barrier(ctx: Context) -> Program:
    """Returns once every local rank has entered."""
    g, h = ctx.next_chunk()
    if need := ctx.writable(g):
        yield need
    tick = ctx.written(h)
    if need := ctx.unmet(READY, ctx.others, tick):
        yield need
    ctx.check(ctx.others, h)
    ctx.release(g)
