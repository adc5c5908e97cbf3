"""Gradient compression for synchronisation: top-k sparsification with error feedback,
and a float16 wire codec.

A codec turns this rank's gradient into what goes on the wire and the ranks'
contributions back into their sum:

* :class:`TopK` ``(ratio)`` keeps the ``ceil(ratio * n)`` entries of largest magnitude
  of ``gradient + residual`` and sends them as int32 indices and values; what it drops
  becomes the residual added to the next step's gradient (error feedback, Stich et al.
  2018; Lin et al. 2018). Every rank sends the same count, so the pieces travel in one
  all-gather each, and each rank adds them up in rank order.
* :class:`Float16` sends float16 and adds the ranks' values up in float32 (or the
  gradient's own wider dtype).
* :class:`Quantized` sends int8 or int4 codes with a float32 scale per block and adds
  the ranks' values up in float64, the same sum on every rank
  (:mod:`shardwire.worker.training.quantize`).

Codecs keep per-tensor state (the residual), keyed by the tensor's position in the
gradient list, so one codec serves one model.
"""

from __future__ import annotations

import math

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.collectives import Group
from shardwire.worker.training import quantize


class Codec:
    """How gradients are exchanged; ``None`` means a plain all-reduce."""

    def wire_bytes(self, grad: np.ndarray) -> int:
        """Bytes this rank puts on the wire for ``grad`` (per exchange)."""
        raise NotImplementedError

    async def sum(self, group: Group, index: int, grad: np.ndarray) -> np.ndarray:
        """The sum over ``group`` of every rank's (compressed) ``grad``."""
        raise NotImplementedError


class TopK(Codec):
    """Send the largest-magnitude fraction ``ratio`` of each gradient, with error feedback."""

    def __init__(self, ratio: float) -> None:
        if not 0.0 < ratio <= 1.0:
            raise InvalidArgument(f"top-k ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self.residuals: dict[int, np.ndarray] = {}

    def count(self, size: int) -> int:
        return min(size, max(1, math.ceil(self.ratio * size)))

    def wire_bytes(self, grad: np.ndarray) -> int:
        return self.count(grad.size) * (4 + grad.dtype.itemsize)

    def select(self, index: int, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) to send for ``grad``; updates the residual (pure numpy)."""
        flat = grad.reshape(-1)
        residual = self.residuals.get(index)
        corrected = flat + residual if residual is not None else flat.copy()
        k = self.count(flat.size)
        if k == flat.size:
            chosen = np.arange(flat.size, dtype=np.int64)
        else:
            chosen = np.sort(np.argpartition(np.abs(corrected), flat.size - k)[flat.size - k :])
        values = corrected[chosen].copy()
        corrected[chosen] = 0.0
        self.residuals[index] = corrected  # what was not sent waits for the next step
        return chosen.astype(np.int32), values

    async def sum(self, group: Group, index: int, grad: np.ndarray) -> np.ndarray:
        indices, values = self.select(index, grad)
        all_indices = await group.all_gather(indices)
        all_values = await group.all_gather(values)
        k = indices.size
        total = np.zeros(grad.size, grad.dtype)
        for rank in range(group.size):  # rank order: the same sum on every rank
            part = slice(rank * k, (rank + 1) * k)
            np.add.at(total, all_indices[part], all_values[part])
        return total.reshape(grad.shape)


class Float16(Codec):
    """Send float16; add the ranks' values up in float32 (or wider)."""

    def wire_bytes(self, grad: np.ndarray) -> int:
        return grad.size * 2

    async def sum(self, group: Group, index: int, grad: np.ndarray) -> np.ndarray:
        sent = np.ascontiguousarray(grad.reshape(1, -1), dtype=np.float16)
        everyone = await group.all_gather(sent)
        wide = np.promote_types(grad.dtype, np.float32)
        return everyone.astype(wide).sum(axis=0).astype(grad.dtype).reshape(grad.shape)


class Quantized(Codec):
    """Send ``bits``-bit codes (8 or 4) with a float32 scale per ``block`` values; add the
    ranks' values up in float64, in rank order (bit-identical on every rank)."""

    def __init__(self, bits: int = 8, *, block: int = 256) -> None:
        quantize.layout(0, bits=bits, block=block)  # checks both
        self.bits = bits
        self.block = block

    def layout(self, count: int) -> quantize.CodeLayout:
        return quantize.layout(count, bits=self.bits, block=self.block)

    def wire_bytes(self, grad: np.ndarray) -> int:
        return self.layout(grad.size).nbytes

    async def sum(self, group: Group, index: int, grad: np.ndarray) -> np.ndarray:
        shape = self.layout(grad.size)
        everyone = await group.all_gather(quantize.encode(grad, shape).reshape(1, -1))
        return quantize.decode_sum(everyone, shape).astype(grad.dtype).reshape(grad.shape)


def parse(spec: str) -> Codec | None:
    """A codec from a command-line spec: ``none``, ``fp16``, ``int8``, ``int4`` or
    ``topk:RATIO``."""
    if spec in ("", "none"):
        return None
    if spec == "fp16":
        return Float16()
    if spec in ("int8", "int4"):
        return Quantized(int(spec[3:]))
    if spec.startswith("topk:"):
        return TopK(float(spec.removeprefix("topk:")))
    raise InvalidArgument(f"unknown compression {spec!r}: none, fp16, int8, int4 or topk:RATIO")
