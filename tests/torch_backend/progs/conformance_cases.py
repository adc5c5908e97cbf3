"""The reduction cases of ``conformance.py`` (and the inputs every case uses): every
reducing c10d function, for every dtype and reduce op.

Exact inputs (``values``) must give bit-identical results (sums of small multiples of
1/2 do not round). Gaussian inputs (``noisy``) round: two ranks still agree bit for bit
(a + b == b + a); at more ranks gloo's ring and shardwire add in different orders, and
the results must agree within the bound of ``_tolerance``.

Where shardwire serves a call gloo refuses, the case is an *extension* (``extension``):
the test checks that gloo still refuses it, then compares shardwire's result with what
gloo computes for the same values carried in a dtype it serves (int64 for the integers it
has no kernels for, SUM of halved inputs for PREMUL_SUM(1/2), complex64 for complex32).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from conformance import Pair, Runner, done

warnings.filterwarnings("ignore", category=FutureWarning)  # the deprecated spellings
warnings.filterwarnings("ignore", category=UserWarning)

DTYPES = [
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
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
# Enough for a subgroup, whose calls differ from the world's in their ranks, not dtypes:
# one of each kind of dtype the backend treats differently.
SOME_DTYPES = [
    torch.bool,
    torch.int8,
    torch.int64,
    torch.uint32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.complex64,
    torch.float8_e5m2,
]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
    "premul_sum": dist._make_nccl_premul_sum(0.5),
}
_UNSIGNED = {torch.uint8, torch.uint16, torch.uint32, torch.uint64}

Shape = tuple[int, ...]


def values(dtype: torch.dtype, shape: Shape, rank: int, salt: int, *, wide: bool) -> torch.Tensor:
    """Deterministic inputs of one rank. Narrow: small multiples of 1/2 in [-1, 1.5], so
    that sums, products and halvings of up to 4 ranks are exact in every dtype (a
    difference is a difference, never rounding). Wide: 97 distinct values, for movement."""
    n = math.prod(shape)
    k = torch.arange(n) * 7 + rank * 31 + salt * 13
    k = k % 97 - 40 if wide else k % 6 - 2
    if dtype == torch.bool:
        v = k % 2 == 0
    elif dtype.is_complex:
        v = torch.complex(k * 0.5, (k + 1) * 0.25).to(torch.complex128).to(dtype)
    elif dtype.is_floating_point:
        v = (k.double() * 0.5).to(dtype)
    else:
        v = (k - k.min() if dtype in _UNSIGNED and n else k).to(dtype)
    return v.reshape(shape)


def noisy(dtype: torch.dtype, shape: Shape, rank: int, salt: int) -> torch.Tensor:
    """Gaussian inputs, whose sums round: different summation orders differ."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    real = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(shape, generator=g, dtype=real).to(dtype)


_SPECIAL = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, -2.0]


def specials(dtype: torch.dtype, shape: Shape, rank: int, salt: int) -> torch.Tensor:
    """NaN, infinities and signed zeros, met in different orders at different places."""
    n = math.prod(shape)
    picks = [_SPECIAL[(i * 3 + rank * 2 + salt) % len(_SPECIAL)] for i in range(n)]
    return torch.tensor(picks, dtype=torch.float64).to(dtype).reshape(shape)


# ---- reductions ------------------------------------------------------------------------

# (name, input shapes for a group of n, call(group, rank, inputs, op, async) -> outputs,
#  pick(bounds of every input, rank) -> bounds of every output)
Call = Callable[[dist.ProcessGroup, int, list[torch.Tensor], object, bool], list[torch.Tensor]]
Pick = Callable[[list[torch.Tensor], int], list[torch.Tensor]]


def _all_reduce_transposed(g, r, ins, op, a):
    t = ins[0].t()  # not contiguous
    done(dist.all_reduce(t, op=op, group=g, async_op=a))
    return [t]


def _all_reduce(g, r, ins, op, a):
    done(dist.all_reduce(ins[0], op=op, group=g, async_op=a))
    return ins


def _all_reduce_coalesced(g, r, ins, op, a):
    done(dist.all_reduce_coalesced(ins, op=op, group=g, async_op=a))
    return ins


def _reduce(g, r, ins, op, a):
    root = g.size() - 1
    done(dist.reduce(ins[0], group_dst=root, op=op, group=g, async_op=a))
    # only the root's tensor is specified: gloo leaves partial sums in the others' (where
    # shardwire leaves their inputs)
    return ins if r == root else []


def _reduce_scatter(g, r, ins, op, a):
    out = torch.full_like(ins[r], 7)
    done(dist.reduce_scatter(out, ins, op=op, group=g, async_op=a))
    return [out]


def _reduce_scatter_tensor(g, r, ins, op, a):
    x = ins[0]
    out = torch.full((x.shape[0] // g.size(), *x.shape[1:]), 7, dtype=x.dtype)
    done(dist.reduce_scatter_tensor(out, x, op=op, group=g, async_op=a))
    return [out]


def _coalesced(fn: Callable[..., object], g, ins, outs, op, a):
    with dist._coalescing_manager(group=g, async_ops=a) as cm:
        for i, o in zip(ins, outs, strict=True):
            fn(o, i, op=op, group=g) if o is not None else fn(i, op=op, group=g)
    if a:
        cm.wait()


def _manager_reduce_scatter(g, r, ins, op, a):
    n = g.size()
    outs = [torch.full((x.shape[0] // n, *x.shape[1:]), 7, dtype=x.dtype) for x in ins]
    _coalesced(dist.reduce_scatter_tensor, g, ins, outs, op, a)
    return outs


def _manager_all_reduce(g, r, ins, op, a):
    _coalesced(dist.all_reduce, g, ins, [None] * len(ins), op, a)
    return ins


def _chunk(b: torch.Tensor, n: int, r: int) -> torch.Tensor:
    return b.reshape(n, -1, *b.shape[1:])[r] if b.numel() else b[:0]


REDUCTIONS: list[tuple[str, Callable[[int], list[Shape]], Call, Pick]] = [
    ("all_reduce", lambda n: [(2, 3)], _all_reduce, lambda b, r: b),
    ("all_reduce empty", lambda n: [(0,)], _all_reduce, lambda b, r: b),
    (
        "all_reduce transposed",
        lambda n: [(3, 2)],
        _all_reduce_transposed,
        lambda b, r: [b[0].transpose(0, 1)],
    ),
    ("all_reduce_coalesced", lambda n: [(3,), (2, 2)], _all_reduce_coalesced, lambda b, r: b),
    ("reduce", lambda n: [(2, 3)], _reduce, lambda b, r: b),
    ("reduce_scatter", lambda n: [(2,)] * n, _reduce_scatter, lambda b, r: [b[r]]),
    (
        "reduce_scatter uneven",
        lambda n: [(p + 1,) for p in range(n)],
        _reduce_scatter,
        lambda b, r: [b[r]],
    ),
    (
        "reduce_scatter_tensor",
        lambda n: [(2 * n, 3)],
        _reduce_scatter_tensor,
        lambda b, r: [_chunk(b[0], len(b[0]) // 2, r)],
    ),
    ("reduce_scatter_tensor empty", lambda n: [(0,)], _reduce_scatter_tensor, lambda b, r: b),
    (
        "coalesced reduce_scatter_tensor",
        lambda n: [(2 * n,), (n, 3)],
        _manager_reduce_scatter,
        lambda b, r: [_chunk(x, len(x) // k, r) for x, k in zip(b, (2, 1), strict=True)],
    ),
    ("coalesced all_reduce", lambda n: [(3,), (2,)], _manager_all_reduce, lambda b, r: b),
]


def _tolerance(
    dtype: torch.dtype, name: str, ins: list[list[torch.Tensor]], n: int
) -> list[torch.Tensor]:
    """How far two summation (or multiplication) orders of ``ins`` (every rank's inputs)
    may differ: each order rounds n - 1 times, each rounding within half an ulp of its
    partial result, so the two are within (n - 1) eps sum|x| (eps: the dtype's machine
    epsilon); a product's within (n - 1) eps |prod x|. The scale of AVG and PREMUL_SUM
    (1/n, 1/2) is exact."""
    eps = torch.finfo(dtype).eps
    out = []
    for i in range(len(ins[0])):
        xs = [_real(rank[i]).double() for rank in ins]
        if name == "product":
            bound = torch.stack(xs).prod(0).abs() * (n - 1) * eps * 1.01
        else:
            bound = torch.stack(xs).abs().sum(0) * (n - 1) * eps
            bound = bound / n if name == "avg" else bound / 2 if name == "premul_sum" else bound
        out.append(bound)
    return out


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


_WIDE_INTS = (torch.int16, torch.uint16, torch.uint32, torch.uint64)


def extension(label: str, name: str, dtype: torch.dtype) -> dict[str, object] | None:
    """How gloo computes a reduction shardwire serves and gloo refuses (the keyword
    arguments of ``_case`` for the reference), or None where gloo serves the call."""
    if (
        name == "premul_sum"
        and dtype.itemsize > 1
        and (dtype.is_floating_point or dtype.is_complex)
    ):
        return {"scale": 0.5, "as_sum": True}  # torch's factor scales each input
    if dtype in _WIDE_INTS and name != "avg":
        return {"wire": torch.int64}  # gloo has no kernels for these integers
    if dtype == torch.complex32 and name == "avg" and "all_reduce" not in label:
        return {"wire": torch.complex64}  # all_reduce views it as float16 (gloo's AVG)
    return None


def _case(call, shapes, dtype, op, data, *, wire=None, scale=None, as_sum=False):
    """A reduction with fresh inputs; ``scale``: multiply them first; ``wire``: hand the
    backend them in that dtype, and give back the outputs in ``dtype``."""

    def case(g, a):
        ins = [data(dtype, s, g.rank(), i) for i, s in enumerate(shapes(g.size()))]
        ins = [x * scale if scale is not None else x for x in ins]
        op_ = OPS["sum"] if as_sum else op
        if wire is None:
            return call(g, g.rank(), ins, op_, a)
        return [o.to(dtype) for o in call(g, g.rank(), [x.to(wire) for x in ins], op_, a)]

    return case


def _exact(dtype, shape, rank, salt):
    return values(dtype, shape, rank, salt, wide=False)


def reductions(run: Runner, pair: Pair, dtypes: list[torch.dtype], *, async_op: bool) -> None:
    n, r = pair.gloo.size(), pair.gloo.rank()
    for label, shapes, call, pick in REDUCTIONS:
        for dtype in dtypes:
            for name, op in OPS.items():
                how = extension(label, name, dtype)
                ref = _case(call, shapes, dtype, op, _exact, **how) if how else None
                run.check(
                    f"{label} {name} {dtype}",
                    _case(call, shapes, dtype, op, _exact),
                    pair,
                    async_op=async_op,
                    reference=ref,
                )
        for dtype in [d for d in dtypes if d.is_floating_point and d.itemsize > 1]:
            for name in ("sum", "product", "min", "max"):

                def nan_wins(outs, shapes=shapes, pick=pick, dtype=dtype):
                    every = [
                        [specials(dtype, s, k, i) for i, s in enumerate(shapes(n))]
                        for k in range(n)
                    ]
                    nan = [torch.stack(x).isnan().any(0) for x in zip(*every, strict=True)]
                    return [
                        o.masked_fill(m, math.nan) for o, m in zip(outs, pick(nan, r), strict=True)
                    ]

                # gloo's MIN and MAX keep their first operand when the other is NaN, so
                # its result depends on the order it meets the ranks in; shardwire's
                # propagate NaN, as torch.minimum and torch.maximum do. The sign of a
                # zero is left to the order too (compared as equal).
                run.check(
                    f"{label} {name} {dtype} nan inf -0",
                    _case(call, shapes, dtype, OPS[name], specials),
                    pair,
                    async_op=async_op,
                    expect=nan_wins if name in ("min", "max") else None,
                )
        # where rounding happens: sums and products of values that do not add up exactly
        for dtype in dtypes:
            if not (dtype.is_floating_point or dtype.is_complex) or dtype.itemsize == 1:
                continue
            for name in ("sum", "avg", "product", "premul_sum"):
                how = extension(label, name, dtype)

                def tol(shapes=shapes, pick=pick, dtype=dtype, name=name):
                    every = [
                        [noisy(dtype, s, k, i) for i, s in enumerate(shapes(n))] for k in range(n)
                    ]
                    return pick(_tolerance(_real_dtype(dtype), name, every, n), r)

                # a + b == b + a: two ranks add in the same order, bit for bit
                run.check(
                    f"{label} {name} {dtype} rounding",
                    _case(call, shapes, dtype, OPS[name], noisy),
                    pair,
                    async_op=async_op,
                    tol=None if n <= 2 else tol,
                    reference=_case(call, shapes, dtype, OPS[name], noisy, **how) if how else None,
                )


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.view_as_real(torch.empty(0, dtype=dtype)).dtype if dtype.is_complex else dtype
