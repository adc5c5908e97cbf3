"""Tensor meta carried by data frames, with the dtype allowlist and size checks."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from shardwire.protocol.errors import ProtocolError

# Only plain little-endian numeric dtypes cross the wire: no object arrays, no structured
# dtypes, nothing whose bytes could mean code or pointers.
ALLOWED_DTYPES: frozenset[str] = frozenset(
    {
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    }
)
MAX_NDIM = 32
MAX_OP_CHARS = 256  # op names carry a collective's signature (name, dtype, sizes, root)


class Tag(NamedTuple):
    """Routing key of a data frame: which group, which collective call, which step of it."""

    group: int
    seq: int
    step: int = 0


# dtype -> canonical name, for allowed dtypes only (native/little-endian byte order).
# A dict lookup here replaces numpy's dtype.name property, which costs microseconds.
_NAMES: dict[np.dtype[Any], str] = {np.dtype(name): name for name in ALLOWED_DTYPES}
_ITEMSIZE: dict[str, int] = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


class TensorMeta(NamedTuple):
    """Everything a receiver needs to route and validate a data frame's payload."""

    src: int
    tag: Tag
    op: str
    dtype: str
    shape: tuple[int, ...]
    generation: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "group": self.tag.group,
            "seq": self.tag.seq,
            "step": self.tag.step,
            "op": self.op,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "gen": self.generation,
        }

    @classmethod
    def for_array(
        cls, array: np.ndarray, *, src: int, tag: Tag, op: str, generation: int = 0
    ) -> TensorMeta:
        return cls(src, tag, op, check_dtype(array.dtype), array.shape, generation)


def check_dtype(dtype: np.dtype[Any] | str) -> str:
    """Return the canonical dtype name, or raise if it may not cross the wire."""
    name = _NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is not None:
        return name
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is None:
        raise ProtocolError(f"dtype {dt!s} is not allowed on the wire ({sorted(ALLOWED_DTYPES)})")
    return name


def _int(meta: dict[str, Any], key: str, *, low: int = 0) -> int:
    value = meta.get(key)
    if type(value) is not int or value < low:
        raise ProtocolError(f"data frame field {key!r} must be an integer >= {low}, got {value!r}")
    return value


def parse_tensor_meta(meta: dict[str, Any], payload_len: int | None) -> TensorMeta:
    """Validate a data frame's meta against its announced payload length (None: the
    payload travels elsewhere, through shared memory)."""
    dtype = meta.get("dtype")
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"data frame dtype {dtype!r} is not in the allowlist")
    shape = meta.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"data frame shape {shape!r} is not a list of non-negative ints")
    op = meta.get("op")
    if not isinstance(op, str) or len(op) > MAX_OP_CHARS:
        raise ProtocolError(f"data frame op {op!r} is not a short string")
    tag = Tag(_int(meta, "group"), _int(meta, "seq"), _int(meta, "step"))
    tm = TensorMeta(_int(meta, "src"), tag, op, dtype, tuple(shape), _int(meta, "gen"))
    if payload_len is not None and tm.nbytes != payload_len:
        raise ProtocolError(
            f"data frame from rank {tm.src} for {op} #{tag.seq}: dtype {dtype} shape {shape} "
            f"needs {tm.nbytes} bytes, frame announces {payload_len}"
        )
    return tm
