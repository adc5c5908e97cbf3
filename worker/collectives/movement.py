"""Collectives that move data without reducing it (gather, scatter, all_to_all, barrier,
small objects) and point-to-point messages, as the base of :class:`Group`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardwire.protocol import Tag
from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.arena import programs
from shardwire.worker.collectives import bruck, small
from shardwire.worker.collectives.args import dtype_name, flat, out_array, sizes_text
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.core import GroupCore
from shardwire.worker.collectives.layout import offsets
from shardwire.worker.collectives.plan import DIRECT_MAX, P2P_BASE, Algorithm, choose
from shardwire.worker.collectives.work import Pending


class Movement(GroupCore):
    """gather, scatter, all_to_all, barrier, object collectives, send and recv."""

    def gather(
        self,
        x: np.ndarray,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray | None]:
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (others get None)."""
        self._check_root(root)
        sizes = [len(x)] * self.size if sizes is None else list(sizes)
        row_shape = x.shape[1:]
        segs = offsets(sizes)
        src = flat(x, "x")
        signature = f"gather:{dtype_name(x.dtype)}:{list(row_shape)}:{sizes_text(sizes)}:{root}"
        result = out_array(out, (sum(sizes), *row_shape), x.dtype) if self.rank == root else None

        async def algorithm(c: Call) -> np.ndarray | None:
            if c.choose("gather", x.nbytes) == Algorithm.TREE:
                row = math.prod(row_shape)
                gathered = await small.gather_tree(c, src, [k * row for k in sizes], root)
                if gathered is None:
                    return None
                assert result is not None
                np.copyto(result.reshape(-1), gathered)
                return result
            if c.rank != root:
                await c.send(root, x, 0)
                return None
            assert result is not None
            incoming = {p: result[a:b] for p, (a, b) in enumerate(segs)}
            await small.exchange(c, {}, incoming)
            np.copyto(incoming[c.rank].reshape(-1), src)
            return result

        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes)

    def scatter(
        self,
        x: np.ndarray | None,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Root splits ``x`` along axis 0 (equal chunks or ``sizes``); rank r gets chunk r.
        Non-roots pass ``None`` (or an ``out`` array of their chunk's shape)."""
        self._check_root(root)
        if self.rank == root:
            if x is None:
                raise InvalidArgument("scatter: the root must pass the array to split")
            sizes = self._split(len(x), sizes, "scatter input")
            chunks = [x[a:b] for a, b in offsets(sizes)]
            for chunk in chunks:
                flat(chunk, "x")
        signature = f"scatter:{root}"

        async def algorithm(c: Call) -> np.ndarray:
            if c.choose("scatter", 0) == Algorithm.TREE:
                got = await small.scatter_tree(c, chunks if c.rank == root else None, root)
                if out is None:
                    return got
                np.copyto(out, got.reshape(out.shape))
                return out
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
            nbytes=0 if x is None else x.nbytes,
        )

    def all_to_all(
        self,
        x: np.ndarray,
        *,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Send part p of ``x`` (axis 0, equal or ``send_splits``) to rank p; return the
        parts received, concatenated in rank order (into a buffer of ``recv_splits``
        rows each, when given).

        Above 8 ranks a call without ``recv_splits`` runs Bruck's algorithm: each rank
        talks to about log2 n others and a block crosses about log2(n)/2 links, which
        suits small blocks (counts, metadata). With ``recv_splits`` every block goes
        straight to its rank, as large exchanges should. Every rank of a call must give
        ``recv_splits`` or none must."""
        send_splits = self._split(len(x), send_splits, "all_to_all input")
        parts = [x[a:b] for a, b in offsets(send_splits)]
        for part in parts:
            flat(part, "x")
        row_shape = x.shape[1:]
        result = None
        if recv_splits is not None:
            recv_splits = list(recv_splits)
            result = np.empty((sum(recv_splits), *row_shape), x.dtype)
        # above 8 ranks, Bruck's algorithm (log2 n peers) unless the caller knows what it
        # receives (a large exchange, straight to every rank); the way is part of the
        # signature, so ranks that call it differently fail as a mismatch, not a hang
        way = (
            Algorithm.DIRECT
            if recv_splits is not None
            else choose("all_to_all", x.nbytes, self.size)
        )
        signature = f"all_to_all:{dtype_name(x.dtype)}:{list(row_shape)}:{way}"

        async def algorithm(c: Call) -> np.ndarray:
            if way == Algorithm.BRUCK:
                blocks = await bruck.all_to_all(c, [p.ravel() for p in parts], x.dtype)
                return np.concatenate(blocks).reshape(-1, *row_shape)
            if result is not None:
                assert recv_splits is not None
                incoming = {p: result[a:b] for p, (a, b) in enumerate(offsets(recv_splits))}
                await small.exchange(c, dict(enumerate(parts)), incoming)
                np.copyto(incoming[c.rank], parts[c.rank])
                return result
            got = await small.exchange(c, dict(enumerate(parts)), dict.fromkeys(range(c.size)))
            pieces = [got[p] if p != c.rank else parts[p] for p in range(c.size)]
            return np.concatenate([g.reshape(-1, *row_shape) for g in pieces])

        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes)

    def barrier(self, *, timeout: float | None = None) -> Pending[None]:
        """Return once every member has entered the barrier."""

        async def algorithm(c: Call) -> None:
            if c.size > 1:
                await small.barrier(c)

        return self._start("barrier", algorithm, timeout=timeout, arena=(programs.barrier, None))

    # ---- objects and point to point ---------------------------------------------------

    def broadcast_object(
        self, obj: Any = None, *, root: int = 0, timeout: float | None = None
    ) -> Pending[Any]:
        """Root's small msgpack-able value, on every rank."""
        self._check_root(root)
        payload = np.frombuffer(pack_object(obj), np.uint8) if self.rank == root else None

        async def algorithm(c: Call) -> Any:
            got = await small.broadcast_tree(c, payload, root) if c.size > 1 else payload
            assert got is not None
            return unpack_object(got.tobytes())

        return self._start(f"broadcast_object:{root}", algorithm, timeout=timeout)

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Pending[list[Any]]:
        """Every rank's small msgpack-able value, as a list in rank order."""
        payload = np.frombuffer(pack_object(obj), np.uint8)

        async def algorithm(c: Call) -> list[Any]:
            everyone = range(c.size)
            got = await small.exchange(c, dict.fromkeys(everyone, payload), dict.fromkeys(everyone))
            got[c.rank] = payload
            return [unpack_object(got[p].tobytes()) for p in range(c.size)]

        return self._start("all_gather_object", algorithm, timeout=timeout)

    def gather_object(
        self, obj: Any, *, root: int = 0, timeout: float | None = None
    ) -> Pending[list[Any] | None]:
        """Every rank's small msgpack-able value, as a list in rank order on ``root``
        (None elsewhere): the bytes grow with the group, not with its square as when
        every rank needs every value; above 8 ranks they go up a binomial tree, so each
        rank talks to about log2 n others."""
        self._check_root(root)
        payload = np.frombuffer(pack_object(obj), np.uint8)

        async def algorithm(c: Call) -> list[Any] | None:
            if c.size > DIRECT_MAX:  # up a tree: log2 n peers, not every rank to the root
                blobs = await small.gather_blobs_tree(c, payload, root)
                return None if blobs is None else [unpack_object(b.tobytes()) for b in blobs]
            if c.rank != root:
                await c.send(root, payload, 0)
                return None
            got = await small.exchange(c, {}, dict.fromkeys(range(c.size)))
            got[c.rank] = payload
            return [unpack_object(got[p].tobytes()) for p in range(c.size)]

        return self._start(f"gather_object:{root}", algorithm, timeout=timeout)

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

    async def recv_any(
        self, *, tag: int = 0, out: np.ndarray | None = None
    ) -> tuple[int, np.ndarray]:
        """Point-to-point receive of the next message with ``tag`` from any rank of the
        group: (its group rank, the array). A receive naming its source is served first."""
        self._check()
        src, array = await self.transport.recv_any(
            tag=self._p2p(tag), op="p2p", out=out, timeout=self.timeout
        )
        return self.ranks.index(src), array

    # ---- helpers -----------------------------------------------------------------------

    def _p2p(self, tag: int) -> Tag:
        if not 0 <= tag < P2P_BASE:
            raise InvalidArgument(f"tag must be in [0, 2**40), got {tag}")
        return Tag(self.group_id, P2P_BASE + tag, 0)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise InvalidArgument(f"root {root} is not a rank of this group of {self.size}")

    def _split(self, length: int, sizes: Sequence[int] | None, what: str) -> list[int]:
        if sizes is None:
            if length % self.size:
                raise InvalidArgument(
                    f"{what} has {length} rows, not divisible by {self.size} "
                    "ranks; pass explicit sizes"
                )
            return [length // self.size] * self.size
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.size or sum(sizes) != length or min(sizes) < 0:
            raise InvalidArgument(
                f"{what}: sizes {sizes} must be {self.size} non-negative counts summing to {length}"
            )
        return sizes
