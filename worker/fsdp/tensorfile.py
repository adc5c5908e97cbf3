"""Writing safetensors files tensor by tensor.

``safetensors.numpy.save_file`` serialises the whole file in memory first, one more copy
of every byte; checkpoints write each array straight from memory instead, and
consolidation produces one tensor at a time. The format is small: an 8-byte
little-endian header size, a JSON header (each tensor's dtype, shape and byte offsets,
plus ``__metadata__``), padded with spaces to a multiple of 8, then the bytes in header
order. The ``safetensors`` package reads what this writes (tested).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


@dataclass(frozen=True)
class Spec:
    """One tensor to write: its name, dtype, shape and how to get its values."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    values: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write(
    path: Path,
    specs: list[Spec],
    *,
    metadata: dict[str, str],
    each: Callable[[str, np.ndarray], object] | None = None,
) -> dict[str, list[int]]:
    """Write ``path`` (fsynced); returns each tensor's absolute byte range. ``each`` is
    called with every tensor's values as they are written, in a thread of its own (e.g.
    to digest them meanwhile: hashlib releases the GIL)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _DTYPES[spec.dtype.name],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    ranges = {}
    with ThreadPoolExecutor(max_workers=1) as pool, open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        pending = []
        for spec in specs:
            array = np.ascontiguousarray(spec.values(), dtype=spec.dtype)
            if each is not None:
                pending.append(pool.submit(each, spec.name, array))
            start = fh.tell() - base
            fh.write(array.reshape(-1).view(np.uint8).data)
            ranges[spec.name] = [base + start, base + start + spec.nbytes]
        fh.flush()
        os.fsync(fh.fileno())
        for future in pending:
            future.result()  # a failing callback fails the write
    return ranges


def of(name: str, array: np.ndarray) -> Spec:
    """The spec of an array already in memory."""
    return Spec(name, array.dtype, tuple(array.shape), lambda: array)
