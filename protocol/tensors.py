"""Tensor meta carried by data frames, with the dtype allowlist and size checks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from shardwire.protocol.codec import pack_value
from shardwire.protocol.errors import ProtocolError

if TYPE_CHECKING:
    import numpy as np

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


# dtype (or a name of one) -> canonical name, for allowed dtypes only (native/little-endian
# byte order), filled by the first check (numpy is imported then, not with the protocol:
# a launcher or coordinator never checks a dtype). A dict lookup here replaces numpy's
# dtype.name property, which costs microseconds.
_NAMES: dict[Any, str] = {}
_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}


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


# The meta map of a data frame, packed. Everything but seq and step is the same for every
# message of a call (and usually for every call of a training step), so those fields'
# bytes are packed once and kept; a message then costs two small ints and a join
# (measured ~0.5 us against ~2.3 us for building and packing the dict). The map is the
# same msgpack map any decoder reads; only the order of its keys differs.
_BODIES: dict[tuple[Any, ...], bytes] = {}
_MAX_BODIES = 4096  # distinct (source, group, op, dtype, shape, generation) kept
_FIXMAPS = [bytes((0x80 | n,)) for n in range(16)]  # msgpack map headers, up to 15 pairs
_FIXINTS = [bytes((v,)) for v in range(128)]  # msgpack's one-byte non-negative ints
_SEQ, _STEP = pack_value("seq"), pack_value("step")


def _small_int(value: int) -> bytes:
    return _FIXINTS[value] if 0 <= value < 128 else pack_value(value)


def pack_tensor_meta(meta: TensorMeta, extra: tuple[tuple[str, int], ...] = ()) -> bytes:
    """Pack ``meta.to_wire()`` plus the ``extra`` (key, int) fields as one msgpack map."""
    key = (meta.src, meta.tag.group, meta.op, meta.dtype, meta.shape, meta.generation, extra)
    body = _BODIES.get(key)
    if body is None:
        fields: dict[str, Any] = {
            "src": meta.src,
            "group": meta.tag.group,
            "op": meta.op,
            "dtype": meta.dtype,
            "shape": list(meta.shape),
            "gen": meta.generation,
            **dict(extra),
        }
        body = b"".join(pack_value(k) + pack_value(v) for k, v in fields.items())
        if len(_BODIES) >= _MAX_BODIES:
            _BODIES.clear()
        _BODIES[key] = body
    tag = meta.tag
    return b"".join(
        (_FIXMAPS[8 + len(extra)], body, _SEQ, _small_int(tag.seq), _STEP, _small_int(tag.step))
    )


def check_dtype(dtype: np.dtype[Any] | str) -> str:
    """Return the canonical dtype name, or raise if it may not cross the wire."""
    try:
        name = _NAMES.get(dtype)
    except TypeError:  # an unhashable spec (a structured dtype's fields): numpy reads it
        name = None
    return name if name is not None else _first_check(dtype)


def _first_check(dtype: np.dtype[Any] | str) -> str:
    import numpy as np  # once per dtype: see _NAMES

    if not _NAMES:
        _NAMES.update({np.dtype(name): name for name in ALLOWED_DTYPES})
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is None:
        raise ProtocolError(f"dtype {dt!s} is not allowed on the wire ({sorted(ALLOWED_DTYPES)})")
    if isinstance(dtype, str):
        _NAMES[dtype] = name
    return name


def _int(meta: dict[str, Any], key: str, *, low: int = 0) -> int:
    value = meta.get(key)
    if type(value) is not int or value < low:
        raise ProtocolError(f"data frame field {key!r} must be an integer >= {low}, got {value!r}")
    return value


def parse_tensor_meta(meta: dict[str, Any], payload_len: int | None) -> TensorMeta:
    """Validate a data frame's meta against its announced payload length (None: the
    payload travels elsewhere, through shared memory)."""
    # The common case in one pass of exact type checks; anything unusual goes through
    # the field-by-field checks below, which also word the error.
    try:
        src, group, seq, step, gen = (
            meta["src"],
            meta["group"],
            meta["seq"],
            meta["step"],
            meta["gen"],
        )
        op, dtype, shape = meta["op"], meta["dtype"], meta["shape"]
    except KeyError:
        return _parse_checked(meta, payload_len)
    if (
        type(src) is type(group) is type(seq) is type(step) is type(gen) is int
        and min(src, group, seq, step, gen) >= 0
        and type(op) is str
        and len(op) <= MAX_OP_CHARS
        and type(dtype) is str
        and dtype in _ITEMSIZE
        and type(shape) is list
        and len(shape) <= MAX_NDIM
    ):
        nbytes = _ITEMSIZE[dtype]
        for d in shape:
            if type(d) is not int or d < 0:
                break
            nbytes *= d
        else:
            if payload_len is None or nbytes == payload_len:
                return TensorMeta(src, Tag(group, seq, step), op, dtype, tuple(shape), gen)
    return _parse_checked(meta, payload_len)


def _parse_checked(meta: dict[str, Any], payload_len: int | None) -> TensorMeta:
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
