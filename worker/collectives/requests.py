"""A call's arguments, checked, as the op descriptor its backend runs
(``backends.ops``): one function per collective, for a group of ``size`` in which this
rank is ``rank``. Each names the call by a *signature* (op, dtype, sizes, reduction,
root) that every message of the call carries, so ranks that made different calls fail
as a mismatch, not a hang."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardwire.protocol.codec import pack_object
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.backends import ops
from shardwire.worker.kernels.arrays import dtype_name, flat, out_array, sizes_text
from shardwire.worker.kernels.reduce import ReduceOp, check_op
from shardwire.worker.kernels.segments import offsets


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


def all_reduce(x: np.ndarray, op: ReduceOp | str, out: np.ndarray | None) -> ops.AllReduce:
    op = op if type(op) is ReduceOp else ReduceOp(op)  # inline: the most frequent call
    check_op(op, x.dtype)
    target = x if out is None else out_array(out, x.shape, x.dtype)
    buf = flat(target, "x" if out is None else "out")
    if out is not None:
        np.copyto(target, x)
    signature = f"all_reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}"
    return ops.AllReduce(buf, op, target, signature, x.nbytes)


def reduce_scatter(
    x: np.ndarray,
    op: ReduceOp | str,
    sizes: Sequence[int] | None,
    out: np.ndarray | None,
    *,
    size: int,
    rank: int,
) -> ops.ReduceScatter:
    op = reduction(op, x.dtype)
    rows = split(len(x) if x.ndim else 0, sizes, size, "reduce_scatter input")
    row = math.prod(x.shape[1:])
    segs = [(a * row, b * row) for a, b in offsets(rows)]
    src = flat(x, "x")
    result = out_array(out, (rows[rank], *x.shape[1:]), x.dtype)
    signature = (
        f"reduce_scatter:{dtype_name(x.dtype)}:{list(x.shape)}:{sizes_text(rows)}:{op.value}"
    )
    return ops.ReduceScatter(src, segs, result.reshape(-1), op, result, signature, x.nbytes)


def reduce(
    x: np.ndarray, op: ReduceOp | str, root: int, out: np.ndarray | None, size: int
) -> ops.Reduce:
    op = reduction(op, x.dtype)
    check_root(root, size)
    src = flat(x, "x")
    target = x if out is None else out_array(out, x.shape, x.dtype)
    signature = f"reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}:{root}"
    return ops.Reduce(src, target, op, root, signature, x.nbytes)


def all_gather(
    x: np.ndarray, sizes: Sequence[int] | None, out: np.ndarray | None, size: int, rank: int
) -> ops.AllGather:
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
    return ops.AllGather(src, buf, segs, result, signature, x.nbytes)


def broadcast(x: np.ndarray, root: int, size: int) -> ops.Broadcast:
    check_root(root, size)
    buf = flat(x, "x")
    signature = f"broadcast:{dtype_name(x.dtype)}:{list(x.shape)}:{root}"
    return ops.Broadcast(buf, root, x, signature, x.nbytes)


def gather(
    x: np.ndarray,
    root: int,
    sizes: Sequence[int] | None,
    out: np.ndarray | None,
    *,
    size: int,
    rank: int,
) -> ops.Gather:
    check_root(root, size)
    rows = [len(x)] * size if sizes is None else list(sizes)
    row_shape = x.shape[1:]
    src = flat(x, "x")
    signature = f"gather:{dtype_name(x.dtype)}:{list(row_shape)}:{sizes_text(rows)}:{root}"
    result = out_array(out, (sum(rows), *row_shape), x.dtype) if rank == root else None
    row = math.prod(row_shape)
    return ops.Gather(src, [k * row for k in rows], root, result, signature, x.nbytes)


def scatter(
    x: np.ndarray | None,
    root: int,
    sizes: Sequence[int] | None,
    out: np.ndarray | None,
    *,
    size: int,
    rank: int,
) -> ops.Scatter:
    check_root(root, size)
    chunks = None
    if rank == root:
        if x is None:
            raise InvalidArgument("scatter: the root must pass the array to split")
        rows = split(len(x), sizes, size, "scatter input")
        chunks = [x[a:b] for a, b in offsets(rows)]
        for chunk in chunks:
            flat(chunk, "x")
    return ops.Scatter(chunks, root, out, f"scatter:{root}", 0 if x is None else x.nbytes)


def all_to_all(
    x: np.ndarray,
    send_splits: Sequence[int] | None,
    recv_splits: Sequence[int] | None,
    size: int,
) -> ops.AllToAll:
    rows = split(len(x), send_splits, size, "all_to_all input")
    parts = [x[a:b] for a, b in offsets(rows)]
    for part in parts:
        flat(part, "x")
    row_shape = x.shape[1:]
    out, recv_segs = None, None
    if recv_splits is not None:
        recv = list(recv_splits)
        out = np.empty((sum(recv), *row_shape), x.dtype)
        recv_segs = offsets(recv)
    signature = f"all_to_all:{dtype_name(x.dtype)}:{list(row_shape)}"
    return ops.AllToAll(parts, row_shape, x.dtype, out, recv_segs, signature, x.nbytes)


def objects(obj: Any, mode: str, root: int, size: int, rank: int) -> ops.Objects:
    """A small value's call: ``broadcast`` (root's value), ``all`` or ``gather``."""
    if mode != "all":
        check_root(root, size)
    sends = mode != "broadcast" or rank == root
    payload = np.frombuffer(pack_object(obj), np.uint8) if sends else None
    names = {"broadcast": "broadcast_object", "all": "all_gather_object", "gather": "gather_object"}
    signature = names[mode] if mode == "all" else f"{names[mode]}:{root}"
    return ops.Objects(payload, mode, root, signature)
