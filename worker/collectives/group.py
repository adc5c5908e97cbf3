"""The collectives, as methods of :class:`Group` (torch-like names).

Each method validates its arguments, names the call by a *signature* (op, dtype, sizes,
reduction, root), picks an algorithm by payload size and starts it. Await the result,
or pass ``async_op=True`` for a :class:`Work` handle. Thresholds between algorithms come
from ``benchmarks/collectives.py`` on this class of machine (2 cores, loopback).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardwire.protocol import Tag, check_dtype
from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.worker.collectives import ring, small
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.core import GroupCore, group_id_for
from shardwire.worker.collectives.layout import bounds, offsets
from shardwire.worker.collectives.ops import ReduceOp, check_op, combine, finish

# Up to this many bytes the latency-optimal algorithms win. Measured with
# benchmarks/collectives.py on 2 cores over loopback: all_reduce by recursive doubling vs
# ring at 2 ranks: 256 KiB 230 vs 365 us, 512 KiB 359 vs 433 us, 1 MiB 1636 vs 641 us;
# at 4 ranks: 256 KiB 0.79 vs 2.1 ms, 1 MiB 4.5 vs 4.4 ms, 4 MiB 20 vs 14 ms. Direct
# exchange beat the ring for all_gather / reduce_scatter up to 1 MiB.
ALL_REDUCE_SMALL = 512 * 1024
EXCHANGE_SMALL = 1 << 20
BROADCAST_SMALL = 256 * 1024
_P2P_BASE = 1 << 40  # point-to-point tags live far above collective sequence numbers
_GATHER_STEP = 1 << 30  # second phases use steps far above any ring step


def _sizes(sizes: Sequence[int]) -> str:
    """Sizes for a call signature: readable when short, a checksum when long."""
    text = ",".join(map(str, sizes))
    if len(text) <= 64:
        return f"[{text}]"
    return f"[{len(sizes)} sizes, sum {sum(sizes)}, crc {zlib.crc32(text.encode()):08x}]"


def _flat(array: np.ndarray, what: str) -> np.ndarray:
    check_dtype(array.dtype)
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (use np.ascontiguousarray)")
    return array.reshape(-1)


def _out(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must be {dtype}{list(shape)}, got {out.dtype}{list(out.shape)}")
    _flat(out, "out")
    return out


class Group(GroupCore):
    """Collectives over a set of ranks. See :class:`GroupCore` for failure semantics."""

    def new_group(
        self, ranks: Sequence[int], *, name: str = "", timeout: float | None = None
    ) -> Group:
        """A subgroup; only its members call this. ``name`` tells apart groups with the
        same members. Each group has its own tag space, so groups run concurrently.

        Asking again for a group that is still open (same members and name) returns that
        group. This group owns the subgroup: :meth:`aclose` closes it too."""
        global_ranks = [self.ranks[r] for r in ranks]
        group_id = group_id_for(global_ranks, name)
        live = self.transport.groups.get(group_id)
        if live is not None:
            if list(live.ranks) != global_ranks:
                raise ValueError(
                    f"group id {group_id} of ranks {global_ranks} (name {name!r}) collides "
                    f"with open group {list(live.ranks)}; use another name"
                )
            return live
        group = Group(
            self.transport,
            global_ranks,
            group_id=group_id,
            timeout=self.timeout if timeout is None else timeout,
            recorder=self.recorder,
        )
        self._adopt(group)
        return group

    # ---- reductions --------------------------------------------------------------------

    def all_reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` over the group; in place unless ``out`` is given. Returns it."""
        op = ReduceOp(op)
        check_op(op, x.dtype)
        target = x if out is None else _out(out, x.shape, x.dtype)
        buf = _flat(target, "x" if out is None else "out")
        if out is not None:
            np.copyto(target, x)
        signature = f"all_reduce:{x.dtype}:{x.size}:{op.value}"

        async def algorithm(c: Call) -> np.ndarray:
            if c.size > 1 and buf.nbytes <= ALL_REDUCE_SMALL:
                await small.all_reduce_doubling(c, buf, op)
                finish(op, buf, c.size)
            elif c.size > 1:
                segs = bounds(buf.size, c.size)
                gathered = ring.post_all_gather(c, buf, segs, base_step=_GATHER_STEP)
                await ring.reduce_scatter(c, buf, buf, segs, op)
                a, b = segs[c.rank]
                finish(op, buf[a:b], c.size)
                await ring.all_gather(c, buf, segs, base_step=_GATHER_STEP, receives=gathered)
            return target

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` (all chunks) over the group; rank r gets chunk r of axis 0.

        Chunks are equal (``len(x)`` divisible by the group size) or ``sizes``.
        """
        op = ReduceOp(op)
        check_op(op, x.dtype)
        sizes = self._split(len(x) if x.ndim else 0, sizes, "reduce_scatter input")
        row = math.prod(x.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(sizes)]
        src = _flat(x, "x")
        result = _out(out, (sizes[self.rank], *x.shape[1:]), x.dtype)
        signature = f"reduce_scatter:{x.dtype}:{list(x.shape)}:{_sizes(sizes)}:{op.value}"

        async def algorithm(c: Call) -> np.ndarray:
            a, b = segs[c.rank]
            if c.size > 1 and x.nbytes <= EXCHANGE_SMALL:
                parts = [src[s:e] for s, e in segs]
                peers = [p for p in range(c.size) if p != c.rank]
                got = await small.exchange(c, {p: parts[p] for p in peers}, dict.fromkeys(peers))
                acc = result.reshape(-1)
                np.copyto(acc, got[0] if c.rank else parts[0])
                for p in range(1, c.size):
                    combine(op, acc, got[p] if p != c.rank else parts[p], out=acc)
            elif c.size > 1:
                acc = c.scratch(src.size, src.dtype)
                await ring.reduce_scatter(c, src, acc, segs, op)
                np.copyto(result.reshape(-1), acc[a:b])
            else:
                np.copyto(result.reshape(-1), src[a:b])
            finish(op, result, c.size)
            return result

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        root: int = 0,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` onto ``root``: root returns the result (in ``x`` unless ``out``);
        the others return None and keep ``x`` unchanged."""
        op = ReduceOp(op)
        check_op(op, x.dtype)
        self._check_root(root)
        src = _flat(x, "x")
        target = x if out is None else _out(out, x.shape, x.dtype)
        signature = f"reduce:{x.dtype}:{x.size}:{op.value}:{root}"

        async def algorithm(c: Call) -> np.ndarray | None:
            if c.size > 1 and x.nbytes <= ALL_REDUCE_SMALL:
                work = src.copy()
                await small.reduce_tree(c, work, op, root)
            elif c.size > 1:
                segs = bounds(src.size, c.size)
                acc = c.scratch(src.size, src.dtype)
                await ring.reduce_scatter(c, src, acc, segs, op)
                a, b = segs[c.rank]
                if c.rank == root:
                    incoming = {p: acc[s:e] for p, (s, e) in enumerate(segs)}
                    await small.exchange(c, {}, incoming, step=_GATHER_STEP)
                else:
                    await c.send(root, acc[a:b], _GATHER_STEP)
                work = acc
            else:
                work = src.copy()
            if c.rank != root:
                return None
            finish(op, work, c.size)
            np.copyto(target.reshape(-1), work)
            return target

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    # ---- data movement -----------------------------------------------------------------

    def all_gather(
        self,
        x: np.ndarray,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Concatenate every rank's ``x`` along axis 0 (rank order).

        First dimensions are equal, or given for every rank in ``sizes``.
        """
        local = len(x) if x.ndim else 1
        x2 = x.reshape(1) if x.ndim == 0 else x
        sizes = [local] * self.size if sizes is None else list(sizes)
        if len(sizes) != self.size or sizes[self.rank] != local:
            raise ValueError(
                f"sizes {sizes} must list {self.size} first dimensions, this rank's being {local}"
            )
        row = math.prod(x2.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(sizes)]
        result = _out(out, (sum(sizes), *x2.shape[1:]), x.dtype)
        buf = _flat(result, "out")
        a, b = segs[self.rank]
        np.copyto(buf[a:b], _flat(x2, "x"))
        signature = f"all_gather:{x.dtype}:{list(x2.shape[1:])}:{_sizes(sizes)}"

        async def algorithm(c: Call) -> np.ndarray:
            if c.size > 1 and buf.nbytes <= EXCHANGE_SMALL:
                mine = buf[a:b]
                incoming = {p: buf[s:e] for p, (s, e) in enumerate(segs)}
                await small.exchange(c, dict.fromkeys(range(c.size), mine), incoming)
            elif c.size > 1:
                await ring.all_gather(c, buf, segs)
            return result

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def broadcast(
        self, x: np.ndarray, *, root: int = 0, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Overwrite ``x`` on every rank with root's ``x`` (same shape and dtype)."""
        self._check_root(root)
        buf = _flat(x, "x")
        signature = f"broadcast:{x.dtype}:{list(x.shape)}:{root}"

        async def algorithm(c: Call) -> np.ndarray:
            if c.size > 1 and x.nbytes <= BROADCAST_SMALL:
                await small.broadcast_tree(c, buf, root)
            elif c.size > 1:
                await ring.broadcast_chain(c, buf, root)
            return x

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def gather(
        self,
        x: np.ndarray,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (others get None)."""
        self._check_root(root)
        sizes = [len(x)] * self.size if sizes is None else list(sizes)
        row_shape = x.shape[1:]
        segs = offsets(sizes)
        src = _flat(x, "x")
        signature = f"gather:{x.dtype}:{list(row_shape)}:{_sizes(sizes)}:{root}"
        result = _out(out, (sum(sizes), *row_shape), x.dtype) if self.rank == root else None

        async def algorithm(c: Call) -> np.ndarray | None:
            if c.rank != root:
                await c.send(root, x, 0)
                return None
            assert result is not None
            incoming = {p: result[a:b] for p, (a, b) in enumerate(segs)}
            await small.exchange(c, {}, incoming)
            np.copyto(incoming[c.rank].reshape(-1), src)
            return result

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def scatter(
        self,
        x: np.ndarray | None,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Root splits ``x`` along axis 0 (equal chunks or ``sizes``); rank r gets chunk r.
        Non-roots pass ``None`` (or an ``out`` array of their chunk's shape)."""
        self._check_root(root)
        if self.rank == root:
            if x is None:
                raise ValueError("scatter: the root must pass the array to split")
            sizes = self._split(len(x), sizes, "scatter input")
            chunks = [x[a:b] for a, b in offsets(sizes)]
            for chunk in chunks:
                _flat(chunk, "x")
        signature = f"scatter:{root}"

        async def algorithm(c: Call) -> np.ndarray:
            if c.rank != root:
                return await c.recv(root, 0, out=out)
            await small.exchange(c, dict(enumerate(chunks)), {})
            mine = chunks[c.rank]
            if out is None:
                return mine.copy()
            np.copyto(out, mine)
            return out

        return self._start(
            signature,
            algorithm,
            timeout=timeout,
            async_op=async_op,
            nbytes=0 if x is None else x.nbytes,
        )

    def all_to_all(
        self,
        x: np.ndarray,
        *,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Send part p of ``x`` (axis 0, equal or ``send_splits``) to rank p; return the
        parts received, concatenated in rank order."""
        send_splits = self._split(len(x), send_splits, "all_to_all input")
        parts = [x[a:b] for a, b in offsets(send_splits)]
        for part in parts:
            _flat(part, "x")
        row_shape = x.shape[1:]
        result = None
        if recv_splits is not None:
            recv_splits = list(recv_splits)
            result = np.empty((sum(recv_splits), *row_shape), x.dtype)
        signature = f"all_to_all:{x.dtype}:{list(row_shape)}"

        async def algorithm(c: Call) -> np.ndarray:
            if result is not None:
                assert recv_splits is not None
                incoming = {p: result[a:b] for p, (a, b) in enumerate(offsets(recv_splits))}
                await small.exchange(c, dict(enumerate(parts)), incoming)
                np.copyto(incoming[c.rank], parts[c.rank])
                return result
            got = await small.exchange(c, dict(enumerate(parts)), dict.fromkeys(range(c.size)))
            pieces = [got[p] if p != c.rank else parts[p] for p in range(c.size)]
            return np.concatenate([g.reshape(-1, *row_shape) for g in pieces])

        return self._start(
            signature, algorithm, timeout=timeout, async_op=async_op, nbytes=x.nbytes
        )

    def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Return once every member has entered the barrier."""

        async def algorithm(c: Call) -> None:
            if c.size > 1:
                await small.barrier(c)

        return self._start("barrier", algorithm, timeout=timeout, async_op=async_op)

    # ---- objects and point to point ---------------------------------------------------

    def broadcast_object(
        self, obj: Any = None, *, root: int = 0, timeout: float | None = None
    ) -> Any:
        """Root's small msgpack-able value, on every rank."""
        self._check_root(root)
        payload = np.frombuffer(pack_object(obj), np.uint8) if self.rank == root else None

        async def algorithm(c: Call) -> Any:
            got = await small.broadcast_tree(c, payload, root) if c.size > 1 else payload
            assert got is not None
            return unpack_object(got.tobytes())

        return self._start(f"broadcast_object:{root}", algorithm, timeout=timeout, async_op=False)

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Any:
        """Every rank's small msgpack-able value, as a list in rank order."""
        payload = np.frombuffer(pack_object(obj), np.uint8)

        async def algorithm(c: Call) -> list[Any]:
            everyone = range(c.size)
            got = await small.exchange(c, dict.fromkeys(everyone, payload), dict.fromkeys(everyone))
            got[c.rank] = payload
            return [unpack_object(got[p].tobytes()) for p in range(c.size)]

        return self._start("all_gather_object", algorithm, timeout=timeout, async_op=False)

    async def send(self, x: np.ndarray, dst: int, *, tag: int = 0) -> None:
        """Point-to-point send to group rank ``dst`` (returns when ``x`` is reusable)."""
        self._check()
        await self.transport.send(
            self.ranks[dst], x, tag=self._p2p(tag), op="p2p", timeout=self.timeout
        )

    async def recv(self, src: int, *, tag: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """Point-to-point receive from group rank ``src``."""
        self._check()
        return await self.transport.recv(
            self.ranks[src], tag=self._p2p(tag), op="p2p", out=out, timeout=self.timeout
        )

    # ---- helpers -----------------------------------------------------------------------

    def _p2p(self, tag: int) -> Tag:
        if not 0 <= tag < _P2P_BASE:
            raise ValueError(f"tag must be in [0, 2**40), got {tag}")
        return Tag(self.group_id, _P2P_BASE + tag, 0)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of this group of {self.size}")

    def _split(self, length: int, sizes: Sequence[int] | None, what: str) -> list[int]:
        if sizes is None:
            if length % self.size:
                raise ValueError(
                    f"{what} has {length} rows, not divisible by {self.size} "
                    "ranks; pass explicit sizes"
                )
            return [length // self.size] * self.size
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.size or sum(sizes) != length or min(sizes) < 0:
            raise ValueError(
                f"{what}: sizes {sizes} must be {self.size} non-negative counts summing to {length}"
            )
        return sizes


def algorithm_name(op: str, nbytes: int, size: int) -> str:
    """Which algorithm a call of ``op`` moving ``nbytes`` (benchmark convention) uses."""
    if size == 1:
        return "local"
    if op == "all_reduce":
        return "doubling" if nbytes <= ALL_REDUCE_SMALL else "ring"
    if op in ("all_gather", "reduce_scatter"):
        return "direct" if nbytes <= EXCHANGE_SMALL else "ring"
    if op == "broadcast":
        return "tree" if nbytes <= BROADCAST_SMALL else "chain"
    return "direct"
