"""torch tensors as the numpy arrays shardwire's collectives move, and torch's reduce ops
as shardwire's.

A contiguous CPU tensor is exchanged zero-copy: its numpy view is what the collective
reads and writes. A tensor numpy cannot view (non-contiguous) or reduce (bfloat16) goes
through a staging array, copied back into the tensor when the call completes. Tensors on
any other device are refused with :class:`UnsupportedTensor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardwire.protocol import ShardwireError
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.collectives import ReduceOp


class UnsupportedTensor(ShardwireError, TypeError):
    """A tensor the shardwire backend cannot serve (its device), naming the op."""


_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


@dataclass(frozen=True, slots=True)
class Reduction:
    """A torch reduce op as shardwire runs it: ``op``, after scaling every contribution
    by ``scale`` (torch's PREMUL_SUM; None: no scaling)."""

    op: ReduceOp
    scale: float | None = None


def reduction(op: dist.ReduceOp | dist.ReduceOp.RedOpType, what: str) -> Reduction:
    """shardwire's form of ``op`` (torch's SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR
    and PREMUL_SUM)."""
    if op == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        if factor is None:
            raise InvalidArgument(
                f"{what}: this torch ({torch.__version__}) does not show a Python backend "
                "the factor of ReduceOp.PREMUL_SUM (torch 2.13 does); scale the tensor and "
                "use SUM"
            )
        return Reduction(ReduceOp.SUM, float(factor))
    for theirs, ours in _OPS.items():
        if op == theirs:
            return Reduction(ours)
    raise InvalidArgument(f"{what}: reduce op {op} is not supported by the shardwire backend")


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise UnsupportedTensor(
            f"{what}: the shardwire backend serves CPU tensors, got one on {t.device}; "
            "move it to the CPU or use a backend for that device"
        )


class Staged:
    """One tensor as a numpy array: its own memory where numpy can use it, else a
    staging copy that :meth:`finish` writes back into the tensor."""

    __slots__ = ("array", "tensor", "_staging")

    def __init__(self, tensor: torch.Tensor, what: str, *, reduce: bool, load: bool = True):
        _check_device(tensor, what)
        self.tensor = tensor
        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            if reduce:  # numpy has no bfloat16: reduce in float32, round once at the end
                self._staging: torch.Tensor | None = (
                    t.float() if load else torch.empty(t.shape, dtype=torch.float32)
                )
            else:  # data movement: the bytes, as 16-bit integers
                self._staging = None if t.is_contiguous() else t.contiguous()
                source = t if self._staging is None else self._staging
                self.array = source.view(torch.int16).numpy()
                return
        elif t.is_contiguous() and not t.is_conj() and not t.is_neg():
            self._staging = None
        else:
            self._staging = (
                t.contiguous()
                if load
                else torch.empty_like(t, memory_format=torch.contiguous_format)
            )
        self.array = (t if self._staging is None else self._staging).numpy()

    @property
    def staged(self) -> bool:
        return self._staging is not None

    def flat(self) -> np.ndarray:
        return self.array.reshape(-1)

    def finish(self) -> None:
        """Copy a staged result back into the tensor (nothing when it was in place)."""
        if self._staging is not None:
            with torch.no_grad():  # float32 staging rounds to bfloat16 here
                self.tensor.copy_(self._staging)


def stage_all(
    tensors: list[torch.Tensor], what: str, *, reduce: bool, load: bool = True
) -> list[Staged]:
    return [Staged(t, what, reduce=reduce, load=load) for t in tensors]


def scaled(array: np.ndarray, how: Reduction, *, own: bool = False) -> np.ndarray:
    """The contribution to send: ``array`` itself, or scaled for PREMUL_SUM (a copy,
    unless ``own``: the array is the call's to overwrite)."""
    if how.scale is None:
        return array
    factor = np.asarray(how.scale, dtype=array.dtype)
    if own:
        return np.multiply(array, factor, out=array)
    return np.multiply(array, factor, dtype=array.dtype)


def joined(parts: list[torch.Tensor], what: str, *, reduce: bool) -> tuple[np.ndarray, list[int]]:
    """Tensors laid end to end in one new flat array, and their element counts."""
    arrays = [s.flat() for s in stage_all(parts, what, reduce=reduce)]
    sizes = [a.size for a in arrays]
    if not arrays:
        return np.empty(0, np.float32), sizes
    return np.concatenate(arrays), sizes


def split_into(flat: np.ndarray, outs: list[Staged]) -> None:
    """Copy consecutive pieces of ``flat`` into ``outs`` (then write staged ones back)."""
    at = 0
    for out in outs:
        n = out.array.size
        np.copyto(out.flat(), flat[at : at + n])
        out.finish()
        at += n


def check_sizes(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise InvalidArgument(f"{what}: expected {expected} elements, got {got}")
