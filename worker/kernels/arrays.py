"""Argument checks and signature pieces shared by the collectives."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from shardwire.protocol import check_dtype
from shardwire.protocol.errors import InvalidArgument


def sizes_text(sizes: Sequence[int]) -> str:
    """Sizes for a call signature: readable when short, a checksum when long."""
    text = ",".join(map(str, sizes))
    if len(text) <= 64:
        return f"[{text}]"
    return f"[{len(sizes)} sizes, sum {sum(sizes)}, crc {zlib.crc32(text.encode()):08x}]"


def flat(array: np.ndarray, what: str) -> np.ndarray:
    check_dtype(array.dtype)
    if not array.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous (use np.ascontiguousarray)")
    return array.reshape(-1)


def out_array(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype:
        raise InvalidArgument(f"out must be {dtype}{list(shape)}, got {out.dtype}{list(out.shape)}")
    flat(out, "out")
    return out


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, cached: numpy's own takes microseconds, on every call's signature."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name
