"""Block quantization for exchanges whose sum must be the same on every rank (pure numpy).

Theory of operation: a vector is cut into blocks of ``block`` values; each block is sent as
one float32 scale and one signed code per value (int8: codes in [-127, 127]; int4: codes
in [-7, 7], two to a byte). The scale is the block's largest magnitude over the largest
code, rounded *up* to float32, so no code clips and each value is off by at most half a
scale. The ranks' buffers travel in one all-gather; every rank then decodes every
buffer and adds them in rank order in float64. The same bytes and the same order give
the same sum, to the bit, on every rank: no rank's copy of the model drifts from the
others', which a reduction that requantizes partial sums on the way could not promise.

Per rank on the wire, for ``n`` values: ``n`` bytes (int8) or ``n / 2`` (int4), plus four
bytes of scale per block, against ``4 n`` for float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from shardwire.protocol.errors import InvalidArgument

BITS = (8, 4)


class CodeLayout(NamedTuple):
    """Where a quantized vector's parts lie in its buffer."""

    values: int
    bits: int
    block: int

    @property
    def blocks(self) -> int:
        return math.ceil(self.values / self.block)

    @property
    def padded(self) -> int:
        return self.blocks * self.block

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

    @property
    def code_bytes(self) -> int:
        return self.padded if self.bits == 8 else self.padded // 2

    @property
    def nbytes(self) -> int:
        return 4 * self.blocks + self.code_bytes


def layout(count: int, *, bits: int, block: int) -> CodeLayout:
    """The layout of ``count`` values at ``bits`` per value in blocks of ``block``."""
    if bits not in BITS:
        raise InvalidArgument(f"quantization bits must be one of {BITS}, got {bits}")
    if block < 2 or block % 2:
        raise InvalidArgument(f"quantization block must be an even count >= 2, got {block}")
    return CodeLayout(count, bits, block)


def encode(x: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """``x`` (any float dtype, ``shape.values`` values) as one uint8 buffer."""
    flat = np.asarray(x, dtype=np.float64).reshape(-1)
    if flat.size != shape.values:
        raise InvalidArgument(f"expected {shape.values} values to quantize, got {flat.size}")
    if not np.all(np.isfinite(flat)):
        raise InvalidArgument("cannot quantize a vector holding NaN or infinity")
    blocks = _blocks(flat, shape)
    scales = _scales(blocks, shape)
    safe = np.where(scales > 0, scales, 1).astype(np.float64)
    codes = np.rint(blocks / safe[:, None]).astype(np.int8).reshape(-1)
    out = np.empty(shape.nbytes, np.uint8)
    out[: 4 * shape.blocks] = scales.view(np.uint8)
    if shape.bits == 8:
        out[4 * shape.blocks :] = codes.view(np.uint8)
    else:
        nibbles = (codes + 8).astype(np.uint8)  # 1..15
        out[4 * shape.blocks :] = nibbles[0::2] | (nibbles[1::2] << 4)
    return out


def decode(buffer: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """One rank's buffer back to float64 values."""
    raw = np.asarray(buffer, dtype=np.uint8).reshape(-1)
    if raw.size != shape.nbytes:
        raise InvalidArgument(f"expected a {shape.nbytes}-byte quantized buffer, got {raw.size}")
    scales = raw[: 4 * shape.blocks].copy().view(np.float32).astype(np.float64)
    packed = raw[4 * shape.blocks :]
    if shape.bits == 8:
        codes = packed.view(np.int8).astype(np.float64)
    else:
        codes = np.empty(shape.padded)
        codes[0::2] = (packed & 0x0F).astype(np.float64) - 8
        codes[1::2] = (packed >> 4).astype(np.float64) - 8
    values = codes.reshape(shape.blocks, shape.block) * scales[:, None]
    return values.reshape(-1)[: shape.values]


def decode_sum(gathered: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """The float64 sum of every rank's buffer (rows of ``gathered``, in rank order)."""
    if shape.values == 0:  # nothing was sent (a fragment none of whose elements is here)
        return np.zeros(0)
    rows = np.asarray(gathered, dtype=np.uint8).reshape(-1, shape.nbytes)
    total = np.zeros(shape.values)
    for row in rows:  # rank order, one addition each: the same rounding on every rank
        total += decode(row, shape)
    return total


def error_bound(x: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """The largest error :func:`encode` then :func:`decode` may make on each value of
    ``x``: half its block's scale (one float32 step up, for the rounding of the codes)."""
    scales = _scales(_blocks(np.asarray(x, dtype=np.float64).reshape(-1), shape), shape)
    half = np.nextafter(scales, np.float32(np.inf)).astype(np.float64) / 2
    return np.repeat(half, shape.block)[: shape.values]


def _blocks(flat: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """``flat`` (float64) zero-padded to whole blocks, one row per block."""
    padded = np.zeros(shape.padded)
    padded[: flat.size] = flat
    return padded.reshape(shape.blocks, shape.block)


def _scales(blocks: np.ndarray, shape: CodeLayout) -> np.ndarray:
    """Each block's float32 scale: its largest magnitude over the largest code, rounded
    up so that no code clips."""
    wanted = np.abs(blocks).max(axis=1) / shape.qmax
    scales = wanted.astype(np.float32)
    low = scales.astype(np.float64) < wanted  # float32 rounded down: one step up
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
    return scales
