"""torch tensors as the numpy arrays shardwire's collectives move, and torch's reduce ops
as shardwire's.

A contiguous CPU tensor is exchanged zero-copy: its numpy view is what the collective
reads and writes. A dtype numpy lacks moves as the integers of its width (bfloat16,
float8); a complex tensor reduces as its real and imaginary parts. A tensor numpy cannot
view (non-contiguous) or reduce (bfloat16) goes through a staging array, copied back into
the tensor when the call completes. Tensors on any other device are refused with
:class:`UnsupportedTensor`.

What is refused follows torch's gloo backend (``tests/torch_backend`` compares the two
call by call): MIN, MAX, PRODUCT and the bitwise ops on complex tensors, PREMUL_SUM on
integers, reductions of float8. Beyond gloo, shardwire reduces int16 and the unsigned
integers, serves PREMUL_SUM, and moves float8 in collectives, not only point to point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardwire.protocol import ShardwireError
from shardwire.protocol.errors import InvalidArgument, InvalidType
from shardwire.worker.collectives import ReduceOp


class UnsupportedTensor(ShardwireError, TypeError):
    """A tensor the shardwire backend cannot serve (its device or dtype), naming the op."""


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


def reduction(
    op: dist.ReduceOp | dist.ReduceOp.RedOpType,
    what: str,
    tensors: Sequence[torch.Tensor] = (),
) -> Reduction:
    """shardwire's form of ``op`` (torch's SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR
    and PREMUL_SUM), checked against the dtypes of ``tensors``."""
    how = _reduction(op, what)
    for t in tensors:
        if t.is_complex() and how.op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise InvalidType(
                f"{what}: ReduceOp.{how.op.name} is not defined on complex tensors "
                f"(got {t.dtype}); SUM, AVG and PREMUL_SUM are"
            )
        if how.scale is not None and not (t.is_floating_point() or t.is_complex()):
            raise InvalidType(
                f"{what}: ReduceOp.PREMUL_SUM needs a floating or complex dtype, got {t.dtype}"
            )
    return how


def _reduction(op: dist.ReduceOp | dist.ReduceOp.RedOpType, what: str) -> Reduction:
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


# dtypes numpy holds: every other one moves as the integers of its width, and reduces
# only where noted in ``_convert``
_NUMPY = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.float32,
        torch.float64,
    }
)
_CARRIERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _alias(t: torch.Tensor, what: str, *, reduce: bool) -> torch.Tensor | None:
    """``t``'s memory as a dtype numpy holds, or None where the values must be converted
    (``_convert``). Complex tensors reduce as their real and imaginary parts (SUM and AVG
    act on each, see :func:`reduction`); torch hands a backend complex tensors only for
    reductions (every data movement views them as real first, and gloo refuses them in
    ``gather``), so a complex tensor to move is refused like gloo refuses it."""
    if t.is_complex():
        if not reduce:
            raise UnsupportedTensor(
                f"{what}: the shardwire backend moves complex tensors as "
                "torch.view_as_real(tensor), as torch's other collectives do"
            )
        return None if t.is_conj() else torch.view_as_real(t)
    if t.dtype in _NUMPY:
        return t
    if reduce:
        if t.dtype == torch.bfloat16:
            return None  # numpy has no bfloat16: reduce in float32, round once at the end
        raise UnsupportedTensor(f"{what}: the shardwire backend cannot reduce {t.dtype}")
    carrier = _CARRIERS.get(t.element_size())
    if carrier is None:
        raise UnsupportedTensor(f"{what}: the shardwire backend cannot move {t.dtype}")
    return t.view(carrier)  # data movement: the bytes (bfloat16, float8, ...)


def _convert(t: torch.Tensor, *, load: bool) -> torch.Tensor:
    """A contiguous copy of ``t`` numpy can reduce (``t`` with no alias, see ``_alias``)."""
    if t.is_complex():
        source = t.resolve_conj()
        return torch.view_as_real(source if load else torch.empty_like(source)).contiguous()
    if load:
        return t.to(torch.float32, memory_format=torch.contiguous_format)
    return torch.empty(t.shape, dtype=torch.float32)


class Staged:
    """One tensor as a numpy array: its own memory where numpy can use it, else a
    staging copy that :meth:`finish` writes back into the tensor."""

    __slots__ = ("array", "tensor", "_staging")

    def __init__(self, tensor: torch.Tensor, what: str, *, reduce: bool, load: bool = True):
        _check_device(tensor, what)
        self.tensor = tensor
        t = tensor.detach()
        alias = _alias(t, what, reduce=reduce)
        self._staging: torch.Tensor | None
        if alias is None:
            self._staging = _convert(t, load=load)
        elif alias.is_contiguous() and not alias.is_conj() and not alias.is_neg():
            self._staging = None
        else:
            self._staging = (
                alias.contiguous()
                if load
                else torch.empty_like(alias, memory_format=torch.contiguous_format)
            )
        held = self._staging if self._staging is not None else alias
        assert held is not None  # no alias means a staging copy was made
        self.array = held.numpy()

    @property
    def staged(self) -> bool:
        return self._staging is not None

    def flat(self) -> np.ndarray:
        return self.array.reshape(-1)

    def finish(self) -> None:
        """Copy a staged result back into the tensor (nothing when it was in place)."""
        staging = self._staging
        if staging is None:
            return
        t = self.tensor
        if t.is_complex():
            staging = torch.view_as_complex(staging)
        elif staging.dtype != t.dtype and staging.element_size() == t.element_size():
            staging = staging.view(t.dtype)  # moved as integers of its width
        with torch.no_grad():  # float32 staging rounds to bfloat16 here
            t.copy_(staging)


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


def check_count(what: str, got: int, expected: int, unit: str) -> None:
    if got != expected:
        raise InvalidArgument(f"{what}: expected {expected} {unit}, got {got}")


def check_like(what: str, out: Staged, source: Staged) -> None:
    """``out`` receives a copy of (another rank's) ``source``: same dtype and shape."""
    o, s = out.tensor, source.tensor
    if o.dtype != s.dtype or o.shape != s.shape:
        raise InvalidArgument(
            f"{what}: expected {s.dtype}{list(s.shape)} like the input, "
            f"got {o.dtype}{list(o.shape)}"
        )
