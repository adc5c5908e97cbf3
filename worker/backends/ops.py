"""What a collective call asks for: one descriptor class per op, which checks the call's
arguments and holds them as its backend runs them.

A group hands a call's arguments to its op's ``of`` (for a group of ``size`` in which
this rank is ``rank``), which checks them and builds the descriptor: a named tuple,
immutable and made in a third of the time a frozen dataclass takes, on every call. Its
backend decides how to run it (:meth:`Backend.decide`) and runs it: one function per
backend that serves the op (the links backend serves every op; the arena and the tiers
serve some and hand the others to the links). A descriptor holds flat views of the
caller's arrays, never copies: the call reads its inputs and writes its outputs while it
runs, like every collective.

* ``signature`` names the call (op, dtype, sizes, reduction, root) in every message it
  sends, so ranks that made different calls fail as a mismatch, not a hang;
* ``nbytes`` is the payload the algorithm choice and the flight recorder see;
* ``result`` is the output array the call fills and returns (None where the backend
  makes the result itself).

What every op shares is derived, not written per class: :func:`kind` (the op's name in
signatures, records and traces) from the class's name, and :data:`SIGNS_DECISION`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, get_args

import numpy as np

from shardwire.protocol.codec import pack_object
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.kernels.arrays import dtype_name, flat, out_array, sizes_text
from shardwire.worker.kernels.reduce import ReduceOp, check_op
from shardwire.worker.kernels.segments import offsets

Segments = list[tuple[int, int]]


def reduction(op: ReduceOp | str, dtype: np.dtype) -> ReduceOp:
    """``op`` as a ReduceOp that ``dtype`` allows."""
    op = op if type(op) is ReduceOp else ReduceOp(op)
    check_op(op, dtype)
    return op


def check_root(root: int, size: int) -> None:
    if not 0 <= root < size:
        raise InvalidArgument(f"root {root} is not a rank of this group of {size}")


def split(length: int, sizes: Sequence[int] | None, size: int, what: str) -> list[int]:
    """Rows per rank: equal parts of ``length``, or ``sizes`` checked."""
    if sizes is None:
        if length % size:
            raise InvalidArgument(
                f"{what} has {length} rows, not divisible by {size} ranks; pass explicit sizes"
            )
        return [length // size] * size
    sizes = [int(s) for s in sizes]
    if len(sizes) != size or sum(sizes) != length or min(sizes) < 0:
        raise InvalidArgument(
            f"{what}: sizes {sizes} must be {size} non-negative counts summing to {length}"
        )
    return sizes


def _in_place(x: np.ndarray, out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Where a call that rewrites its input writes: ``x`` itself, or ``out`` given a copy
    of it; and that array flat."""
    if out is None:
        return x, flat(x, "x")
    target = out_array(out, x.shape, x.dtype)
    np.copyto(target, x)
    return target, flat(target, "out")


class AllReduce(NamedTuple):
    """``buf`` (flat) becomes its reduction over the group, in place."""

    buf: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int

    @classmethod
    def of(cls, x: np.ndarray, op: ReduceOp | str, out: np.ndarray | None) -> AllReduce:
        op = op if type(op) is ReduceOp else ReduceOp(op)  # inline: the most frequent call
        check_op(op, x.dtype)
        target, buf = _in_place(x, out)
        signature = f"all_reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}"
        return cls(buf, op, target, signature, x.nbytes)


class Scan(NamedTuple):
    """``buf`` (flat) becomes the reduction of ranks 0..rank's, in place (an inclusive
    prefix reduction, as ``MPI_Scan``; AVG divides rank r's by r + 1)."""

    buf: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int

    @classmethod
    def of(cls, x: np.ndarray, op: ReduceOp | str, out: np.ndarray | None) -> Scan:
        op = reduction(op, x.dtype)
        target, buf = _in_place(x, out)
        signature = f"scan:{dtype_name(x.dtype)}:{x.size}:{op.value}"
        return cls(buf, op, target, signature, x.nbytes)


class ReduceScatter(NamedTuple):
    """``out`` (flat) gets segment ``segs[rank]`` of ``src`` reduced over the group."""

    src: np.ndarray
    segs: Segments
    out: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int

    @classmethod
    def of(
        cls,
        x: np.ndarray,
        op: ReduceOp | str,
        sizes: Sequence[int] | None,
        out: np.ndarray | None,
        *,
        size: int,
        rank: int,
    ) -> ReduceScatter:
        op = reduction(op, x.dtype)
        rows = split(len(x) if x.ndim else 0, sizes, size, "reduce_scatter input")
        row = math.prod(x.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(rows)]
        src = flat(x, "x")
        result = out_array(out, (rows[rank], *x.shape[1:]), x.dtype)
        signature = (
            f"reduce_scatter:{dtype_name(x.dtype)}:{list(x.shape)}:{sizes_text(rows)}:{op.value}"
        )
        return cls(src, segs, result.reshape(-1), op, result, signature, x.nbytes)


class AllGather(NamedTuple):
    """Every ``buf[segs[r]]`` gets rank r's ``src`` (rank order)."""

    src: np.ndarray
    buf: np.ndarray
    segs: Segments
    result: np.ndarray
    signature: str
    nbytes: int

    @classmethod
    def of(
        cls,
        x: np.ndarray,
        sizes: Sequence[int] | None,
        out: np.ndarray | None,
        *,
        size: int,
        rank: int,
    ) -> AllGather:
        local = len(x) if x.ndim else 1
        x2 = x.reshape(1) if x.ndim == 0 else x
        rows = [local] * size if sizes is None else list(sizes)
        if len(rows) != size or rows[rank] != local:
            raise InvalidArgument(
                f"sizes {rows} must list {size} first dimensions, this rank's being {local}"
            )
        row = math.prod(x2.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(rows)]
        result = out_array(out, (sum(rows), *x2.shape[1:]), x.dtype)
        buf = flat(result, "out")
        src = flat(x2, "x")  # read while the call runs, like every collective's input
        signature = f"all_gather:{dtype_name(x.dtype)}:{list(x2.shape[1:])}:{sizes_text(rows)}"
        return cls(src, buf, segs, result, signature, x.nbytes)


class Broadcast(NamedTuple):
    """``buf`` (flat) becomes root's on every rank."""

    buf: np.ndarray
    root: int
    result: np.ndarray
    signature: str
    nbytes: int

    @classmethod
    def of(cls, x: np.ndarray, root: int, *, size: int) -> Broadcast:
        check_root(root, size)
        buf = flat(x, "x")
        signature = f"broadcast:{dtype_name(x.dtype)}:{list(x.shape)}:{root}"
        return cls(buf, root, x, signature, x.nbytes)


class Reduce(NamedTuple):
    """Root's ``target`` gets ``src`` reduced over the group; the others get None."""

    src: np.ndarray
    target: np.ndarray
    op: ReduceOp
    root: int
    signature: str
    nbytes: int
    result: None = None

    @classmethod
    def of(
        cls, x: np.ndarray, op: ReduceOp | str, root: int, out: np.ndarray | None, *, size: int
    ) -> Reduce:
        op = reduction(op, x.dtype)
        check_root(root, size)
        src = flat(x, "x")
        target = x if out is None else out_array(out, x.shape, x.dtype)
        signature = f"reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}:{root}"
        return cls(src, target, op, root, signature, x.nbytes)


class Gather(NamedTuple):
    """Root's ``result`` gets every rank's ``src`` in rank order (``counts`` elements
    each); the others get None."""

    src: np.ndarray
    counts: list[int]
    root: int
    result: np.ndarray | None
    signature: str
    nbytes: int

    @classmethod
    def of(
        cls,
        x: np.ndarray,
        root: int,
        sizes: Sequence[int] | None,
        out: np.ndarray | None,
        *,
        size: int,
        rank: int,
    ) -> Gather:
        check_root(root, size)
        rows = [len(x)] * size if sizes is None else list(sizes)
        row_shape = x.shape[1:]
        src = flat(x, "x")
        signature = f"gather:{dtype_name(x.dtype)}:{list(row_shape)}:{sizes_text(rows)}:{root}"
        result = out_array(out, (sum(rows), *row_shape), x.dtype) if rank == root else None
        row = math.prod(row_shape)
        return cls(src, [k * row for k in rows], root, result, signature, x.nbytes)


class Scatter(NamedTuple):
    """Rank r gets ``chunks[r]`` of the root (the others pass no chunks), into ``out``
    when given."""

    chunks: list[np.ndarray] | None
    root: int
    out: np.ndarray | None
    signature: str
    nbytes: int
    result: None = None

    @classmethod
    def of(
        cls,
        x: np.ndarray | None,
        root: int,
        sizes: Sequence[int] | None,
        out: np.ndarray | None,
        *,
        size: int,
        rank: int,
    ) -> Scatter:
        check_root(root, size)
        chunks = None
        if rank == root:
            if x is None:
                raise InvalidArgument("scatter: the root must pass the array to split")
            rows = split(len(x), sizes, size, "scatter input")
            chunks = [x[a:b] for a, b in offsets(rows)]
            for chunk in chunks:
                flat(chunk, "x")
        return cls(chunks, root, out, f"scatter:{root}", 0 if x is None else x.nbytes)


class AllToAll(NamedTuple):
    """Part p goes to rank p; the parts received are concatenated in rank order (into
    ``out``, of ``recv_segs`` rows, when the receivers gave their sizes). Whether this
    rank gave them is its own argument, so the algorithm decided goes into the signature
    (:data:`SIGNS_DECISION`): ranks that would run different ones fail as a mismatch,
    not a hang."""

    parts: list[np.ndarray]
    data: np.ndarray  # the parts back to back, flat
    counts: np.ndarray  # elements per part
    row_shape: tuple[int, ...]
    dtype: np.dtype
    out: np.ndarray | None
    recv_segs: Segments | None
    signature: str
    nbytes: int
    result: None = None

    @classmethod
    def of(
        cls,
        x: np.ndarray,
        send_splits: Sequence[int] | None,
        recv_splits: Sequence[int] | None,
        *,
        size: int,
    ) -> AllToAll:
        rows = split(len(x), send_splits, size, "all_to_all input")
        data = flat(x, "x")
        parts = [x[a:b] for a, b in offsets(rows)]
        row_shape = x.shape[1:]
        counts = np.array(rows, np.int64) * math.prod(row_shape)
        out, recv_segs = None, None
        if recv_splits is not None:
            recv = list(recv_splits)
            out = np.empty((sum(recv), *row_shape), x.dtype)
            recv_segs = offsets(recv)
        signature = f"all_to_all:{dtype_name(x.dtype)}:{list(row_shape)}"
        return cls(parts, data, counts, row_shape, x.dtype, out, recv_segs, signature, x.nbytes)


class Barrier(NamedTuple):
    """Every member has entered."""

    signature: str = "barrier"
    nbytes: int = 0
    result: None = None


class Objects(NamedTuple):
    """Small msgpack-able values: ``payload`` is this rank's, packed (None on a
    broadcast's non-roots). ``mode``: ``broadcast`` (root's on every rank), ``all`` (a
    list on every rank), ``gather`` (a list on the root)."""

    payload: np.ndarray | None
    mode: str
    root: int
    signature: str
    nbytes: int = 0
    result: None = None

    @classmethod
    def of(cls, obj: Any, mode: str, root: int, *, size: int, rank: int) -> Objects:
        if mode != "all":
            check_root(root, size)
        sends = mode != "broadcast" or rank == root
        payload = np.frombuffer(pack_object(obj), np.uint8) if sends else None
        names = {
            "broadcast": "broadcast_object",
            "all": "all_gather_object",
            "gather": "gather_object",
        }
        signature = names[mode] if mode == "all" else f"{names[mode]}:{root}"
        return cls(payload, mode, root, signature)


Op = (
    AllReduce
    | Scan
    | ReduceScatter
    | AllGather
    | Broadcast
    | Reduce
    | Gather
    | Scatter
    | AllToAll
    | Barrier
    | Objects
)

_KINDS: dict[type, str] = {
    cls: re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower() for cls in get_args(Op)
}

SIGNS_DECISION: frozenset[type] = frozenset({AllToAll})
"""The ops whose algorithm follows from an argument only this rank knows: their
signatures carry the algorithm decided (see :class:`AllToAll`)."""


def kind(op: Op) -> str:
    """The op's name in signatures, records and traces: its class's name in snake case
    (``AllReduce``: ``all_reduce``)."""
    return _KINDS[type(op)]
