"""The links backend: every collective as a flat algorithm over point-to-point links.

:meth:`LinksBackend.decide` asks :func:`~shardwire.worker.backends.algorithms.choose` (the
thresholds are measured there); each op's method below runs the algorithm decided: the
latency-optimal ones of ``backends.small``, the pipelined ring (``backends.ring``) or
the logarithmic rounds of ``backends.bruck``. Every message is tagged by the call
(``Call.tag``), so calls of one group run concurrently and groups never mix.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from shardwire.protocol.codec import unpack_object
from shardwire.worker.backends import bruck, ops, ring, small
from shardwire.worker.backends.algorithms import DIRECT_MAX, GATHER_STEP, Algorithm, choose
from shardwire.worker.backends.base import Backend, Decision, PlacedCall
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.ops import (
    AllGather,
    AllReduce,
    AllToAll,
    Barrier,
    Broadcast,
    Gather,
    Objects,
    Op,
    Reduce,
    ReduceScatter,
    Scan,
    Scatter,
)
from shardwire.worker.kernels.reduce import finish
from shardwire.worker.kernels.segments import bounds, offsets
from shardwire.worker.transport.place import Topology

_A = Algorithm


class LinksBackend(Backend):
    """Flat algorithms over the links between a group's ranks."""

    __slots__ = ("_decisions", "_runs", "_topology", "pinned", "size")
    name = "links"

    def __init__(
        self, size: int, topology: Topology, pinned: Mapping[str, Algorithm] | None = None
    ) -> None:
        self.size = size
        self._topology = topology
        self.pinned = dict(pinned or {})  # op -> the algorithm its group asked for
        self._decisions: dict[tuple[str, int], Decision] = {}
        self._runs: dict[type, Callable[[Any, Call, Algorithm], Awaitable[Any]]] = {
            AllReduce: _all_reduce,
            Scan: _scan,
            ReduceScatter: _reduce_scatter,
            AllGather: _all_gather,
            Broadcast: _broadcast,
            Reduce: _reduce,
            Gather: _gather,
            Scatter: _scatter,
            AllToAll: _all_to_all,
            Barrier: _barrier,
            Objects: _objects,
        }

    def decide(self, op: Op) -> Decision:
        kind = ops.kind(op)
        key = (kind, op.nbytes)
        known = self._decisions.get(key)
        if known is not None and kind not in ("all_to_all", "objects", "barrier"):
            return known
        decision = Decision(self.name, self._algorithm(op, kind))
        if len(self._decisions) < 256:  # the sizes a training step uses, over and over
            self._decisions[key] = decision
        return decision

    def _algorithm(self, op: Op, kind: str) -> Algorithm:
        if self.size == 1:
            return _A.LOCAL
        pinned = self.pinned.get(kind)
        if pinned is not None:
            return pinned
        if isinstance(op, AllToAll) and op.recv_segs is not None:
            return _A.DIRECT  # the receivers know their sizes: every block straight there
        if isinstance(op, Objects):
            if op.mode == "broadcast" or (op.mode == "gather" and self.size > DIRECT_MAX):
                return _A.TREE
            return _A.DIRECT
        if isinstance(op, Barrier):
            return _A.DISSEMINATION
        crowded = self._topology.crowded if kind == "broadcast" else False
        nbytes = op.nbytes
        if isinstance(op, AllGather):  # parts may differ (sizes=): every rank must choose alike
            nbytes = op.buf.nbytes // self.size
        return choose(kind, nbytes, self.size, crowded=crowded, network=self._topology.network)

    def launch(self, op: Op, call: Call, decision: Decision, limit: float) -> PlacedCall:
        return PlacedCall(self.runner(op, decision.algorithm))

    def runner(self, op: Op, how: Algorithm) -> Callable[[Call], Awaitable[Any]]:
        """Run ``op`` by algorithm ``how`` once given its call."""
        run = self._runs[type(op)]
        return lambda c: run(op, c, how)


async def _all_reduce(op: AllReduce, c: Call, how: Algorithm) -> np.ndarray:
    buf = op.buf
    if how == _A.DOUBLING:
        await small.all_reduce_doubling(c, buf, op.op)
        finish(op.op, buf, c.size)
    elif how == _A.RING:
        await ring.all_reduce(c, buf, op.op)
    elif how == _A.BRUCK:
        await bruck.all_reduce(c, buf, op.op)
    return op.result


async def _scan(op: Scan, c: Call, how: Algorithm) -> np.ndarray:
    if how == _A.DOUBLING:
        await small.scan_doubling(c, op.buf, op.op)
    finish(op.op, op.buf, c.rank + 1)
    return op.result


async def _reduce_scatter(op: ReduceScatter, c: Call, how: Algorithm) -> np.ndarray:
    src, segs, acc = op.src, op.segs, op.out
    a, b = segs[c.rank]
    if how == _A.DIRECT:
        parts = [src[s:e] for s, e in segs]
        peers = [p for p in range(c.size) if p != c.rank]
        got = await small.exchange(c, {p: parts[p] for p in peers}, dict.fromkeys(peers))
        np.copyto(acc, got[0] if c.rank else parts[0])
        for p in range(1, c.size):
            c.combine(op.op, acc, got[p] if p != c.rank else parts[p], out=acc)
    elif how in (_A.RING, _A.BRUCK):
        work = c.scratch(src.size, src.dtype)
        scatter = ring.reduce_scatter if how == _A.RING else bruck.reduce_scatter
        await scatter(c, src, work, segs, op.op)
        np.copyto(acc, work[a:b])
    else:
        np.copyto(acc, src[a:b])
    finish(op.op, acc, c.size)
    return op.result


async def _all_gather(op: AllGather, c: Call, how: Algorithm) -> np.ndarray:
    buf, segs = op.buf, op.segs
    a, b = segs[c.rank]
    np.copyto(buf[a:b], op.src)
    if how == _A.DIRECT:
        incoming = {p: buf[s:e] for p, (s, e) in enumerate(segs)}
        await small.exchange(c, dict.fromkeys(range(c.size), buf[a:b]), incoming)
    elif how == _A.RING:
        await ring.all_gather(c, buf, segs)
    elif how == _A.BRUCK:
        await bruck.all_gather(c, buf, segs)
    return op.result


async def _broadcast(op: Broadcast, c: Call, how: Algorithm) -> np.ndarray:
    if how == _A.TREE:
        await small.broadcast_tree(c, op.buf, op.root)
    elif how == _A.CHAIN:
        await ring.broadcast_chain(c, op.buf, op.root)
    return op.result


async def _reduce(op: Reduce, c: Call, how: Algorithm) -> np.ndarray | None:
    src, root = op.src, op.root
    if how == _A.TREE:
        work = src.copy()
        await small.reduce_tree(c, work, op.op, root)
    elif how == _A.RING:
        segs = bounds(src.size, c.size)
        work = c.scratch(src.size, src.dtype)
        await ring.reduce_scatter(c, src, work, segs, op.op)
        a, b = segs[c.rank]
        if c.rank == root:
            incoming = {p: work[s:e] for p, (s, e) in enumerate(segs)}
            await small.exchange(c, {}, incoming, step=GATHER_STEP)
        else:
            await c.send(root, work[a:b], GATHER_STEP)
    else:
        work = src.copy()
    if c.rank != root:
        return None
    finish(op.op, work, c.size)
    np.copyto(op.target.reshape(-1), work)
    return op.target


async def _gather(op: Gather, c: Call, how: Algorithm) -> np.ndarray | None:
    root, result = op.root, op.result
    if how == _A.TREE:
        gathered = await small.gather_tree(c, op.src, op.counts, root)
        if gathered is None or result is None:
            return None
        np.copyto(result.reshape(-1), gathered)
        return result
    if c.rank != root or result is None:
        await c.send(root, op.src, 0)
        return None
    flat = result.reshape(-1)
    incoming = {p: flat[a:b] for p, (a, b) in enumerate(offsets(op.counts))}
    await small.exchange(c, {}, incoming)
    np.copyto(incoming[c.rank], op.src)
    return result


async def _scatter(op: Scatter, c: Call, how: Algorithm) -> np.ndarray:
    root, out = op.root, op.out
    if how == _A.TREE:
        got = await small.scatter_tree(c, op.chunks, root)
        if out is None:
            return got
        np.copyto(out, got.reshape(out.shape))
        return out
    if c.rank != root or op.chunks is None:
        return await c.recv(root, 0, out=out)
    await small.exchange(c, dict(enumerate(op.chunks)), {})
    mine = op.chunks[c.rank]
    if out is None:
        return mine.copy()
    np.copyto(out, mine)
    return out


async def _all_to_all(op: AllToAll, c: Call, how: Algorithm) -> np.ndarray:
    parts, row_shape = op.parts, op.row_shape
    if how == _A.BRUCK:
        flat = await bruck.all_to_all(c, op.data, op.counts)
        return flat.reshape(-1, *row_shape)
    if op.out is not None and op.recv_segs is not None:
        incoming = {p: op.out[a:b] for p, (a, b) in enumerate(op.recv_segs)}
        await small.exchange(c, dict(enumerate(parts)), incoming)
        np.copyto(incoming[c.rank], parts[c.rank])
        return op.out
    got = await small.exchange(c, dict(enumerate(parts)), dict.fromkeys(range(c.size)))
    pieces = [got[p] if p != c.rank else parts[p] for p in range(c.size)]
    return np.concatenate([g.reshape(-1, *row_shape) for g in pieces])


async def _barrier(op: Barrier, c: Call, how: Algorithm) -> None:
    if c.size > 1:
        await small.barrier(c)


async def _objects(op: Objects, c: Call, how: Algorithm) -> Any:
    mine = op.payload
    if op.mode == "broadcast":
        got = await small.broadcast_tree(c, mine, op.root) if c.size > 1 else mine
        assert got is not None
        return unpack_object(got.tobytes())
    assert mine is not None
    if op.mode == "gather" and how == _A.TREE:  # up a tree: log2 n peers, not all to root
        blobs = await small.gather_blobs_tree(c, mine, op.root)
        return None if blobs is None else [unpack_object(b.tobytes()) for b in blobs]
    if op.mode == "gather" and c.rank != op.root:
        await c.send(op.root, mine, 0)
        return None
    everyone = range(c.size)
    sending: dict[int, np.ndarray] = dict.fromkeys(everyone, mine) if op.mode == "all" else {}
    blobs_in = await small.exchange(c, sending, dict.fromkeys(everyone))
    blobs_in[c.rank] = mine
    return [unpack_object(blobs_in[p].tobytes()) for p in everyone]
