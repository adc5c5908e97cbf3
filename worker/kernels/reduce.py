"""Reduction operators and their numpy kernels."""

from __future__ import annotations

import enum

import numpy as np

from shardwire.protocol.errors import InvalidType


class ReduceOp(enum.Enum):
    """How contributions are combined."""

    SUM = "sum"
    AVG = "avg"  # SUM, then divided by the group size (floating dtypes only)
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"  # bitwise and (integers, bool)
    BOR = "bor"
    BXOR = "bxor"

    # Members are singletons compared by identity: hash them as such. Enum's own hash is
    # Python code (0.3 us), paid by every lookup of a call's kernel or kind.
    __hash__ = object.__hash__


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}


def check_op(op: ReduceOp, dtype: np.dtype) -> None:
    """Refuse combinations numpy would silently get wrong."""
    if op is ReduceOp.AVG and dtype.kind != "f":
        raise InvalidType(f"ReduceOp.AVG needs a floating dtype, got {dtype}")
    if op in _BITWISE and dtype.kind not in "iub":
        raise InvalidType(f"ReduceOp.{op.name} needs an integer or bool dtype, got {dtype}")


def combine(op: ReduceOp, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
    """``out = first (op) second``. Callers pass the lower ranks' part first, so every
    rank and every run computes the same expression (bit-identical results)."""
    _UFUNCS[op](first, second, out=out)


def finish(op: ReduceOp, array: np.ndarray, size: int) -> None:
    """Apply the final step of ``op`` (the division of AVG) in place."""
    if op is ReduceOp.AVG and size > 1:
        np.divide(array, size, out=array)
