"""Differential conformance: every c10d call on a shardwire group against the same call
on a gloo group, in the same process, with the same inputs.

    python conformance.py

Started by the tests as torch ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The
default group is gloo; a shardwire group over the same ranks runs beside it, and so do a
subgroup of each (the ranks but the first). A case calls one c10d function the same way on
both and compares what came out: every output tensor, element by element (dtype and shape
too), or that both refused the call. A call shardwire serves and gloo refuses is a
difference too, unless the case names it an extension and says how gloo computes the same
result another way (its ``reference``). Prints a ``diff CASE: ...`` line per difference,
``refused CASE`` per call both refused, ``extension CASE`` per extension, then
``checks N refused M extensions E diffs D``; the test fails on any ``diff``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import shardwire.torch  # noqa: F401  (registers the backend)

# A case: given a group and whether to pass async_op=True, make one c10d call with fresh
# inputs and return the tensors to compare (its outputs, and any input it may change).
Case = Callable[[dist.ProcessGroup, bool], list[torch.Tensor]]
# Per-element bound on |gloo - shardwire|, computed from every rank's inputs; None: exact.
Tol = Callable[[], list[torch.Tensor]] | None
Expect = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class Pair:
    """The same ranks as a gloo group and as a shardwire group."""

    name: str
    gloo: dist.ProcessGroup
    shardwire: dist.ProcessGroup


@dataclass
class Outcome:
    tensors: list[torch.Tensor] | None
    error: BaseException | None

    def describe(self) -> str:
        if self.error is not None:
            return f"raised {type(self.error).__name__}: {str(self.error)[:160]}"
        assert self.tensors is not None
        return "; ".join(_show(t) for t in self.tensors)


def _show(t: torch.Tensor) -> str:
    values = t.reshape(-1)[:12]
    if values.dtype.itemsize == 1 and values.is_floating_point():
        values = values.float()  # float8: tolist() has no Python scalar for it
    return f"{t.dtype}{list(t.shape)} {values.tolist()}"


def attempt(case: Case, group: dist.ProcessGroup, async_op: bool) -> Outcome:
    try:
        return Outcome([t.detach().clone() for t in case(group, async_op)], None)
    except Exception as exc:  # the outcome to compare: which call refuses, not why
        return Outcome(None, exc)


def done(work: object) -> None:
    """Wait for a handle (``Work`` or ``Future``) an async call returned."""
    if work is not None:
        work.wait()  # type: ignore[attr-defined]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Values comparable with ``torch.equal`` (float8 has no arithmetic on CPU)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point() and t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    return t


def mismatch(a: torch.Tensor, b: torch.Tensor, tol: torch.Tensor | None) -> str | None:
    """How ``b`` (shardwire's) differs from ``a`` (gloo's), or None."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = _bits(a), _bits(b)
    if tol is None:
        nan_x = torch.isnan(x) if x.is_floating_point() else torch.zeros_like(x, dtype=torch.bool)
        nan_y = torch.isnan(y) if y.is_floating_point() else nan_x
        if torch.equal(nan_x, nan_y) and torch.equal(x[~nan_x], y[~nan_y]):
            return None
        where = (x != y) & ~(nan_x & nan_y)
        return f"first difference at flat index {int(where.reshape(-1).nonzero()[0])}"
    gap = (x.double() - y.double()).abs()
    over = gap > tol.double().reshape(gap.shape)
    if not bool(over.any()):
        return None
    i = int(over.reshape(-1).nonzero()[0])
    return f"|diff| {gap.reshape(-1)[i]:.3g} over tolerance {tol.reshape(-1)[i]:.3g} at {i}"


class Runner:
    """Runs cases on a pair of groups and counts what it compared."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.checks = 0
        self.refused: list[str] = []
        self.extensions: list[str] = []
        self.diffs: list[str] = []

    def check(
        self,
        name: str,
        case: Case,
        pair: Pair,
        *,
        async_op: bool = False,
        tol: Tol = None,
        reference: Case | None = None,
        expect: Expect | None = None,
    ) -> None:
        """Compare ``case`` on shardwire with ``case`` on gloo, or, for an extension, with
        ``reference`` on gloo (after checking that gloo still refuses ``case``).
        ``expect``: where shardwire differs from gloo by design, what it must produce,
        from gloo's outputs."""
        name = f"{pair.name}/{name}{' async' if async_op else ''}"
        if reference is not None:
            plain = attempt(case, pair.gloo, async_op)
            if plain.error is None:
                self.diff(name, "gloo serves this call now: it is no extension")
                return
            self.extensions.append(name)
        g = attempt(reference or case, pair.gloo, async_op)
        s = attempt(case, pair.shardwire, async_op)
        self.checks += 1
        if g.error is not None and s.error is not None:
            self.refused.append(name)
            return
        if g.error is not None or s.error is not None:
            self.diff(name, f"gloo {g.describe()} | shardwire {s.describe()}")
            return
        assert g.tensors is not None and s.tensors is not None
        if expect is not None and g.tensors:
            g.tensors = expect(g.tensors)
        if len(g.tensors) != len(s.tensors):
            self.diff(name, f"{len(g.tensors)} vs {len(s.tensors)} tensors")
            return
        bounds = tol() if tol is not None and g.tensors else [None] * len(g.tensors)
        for k, (a, b, t) in enumerate(zip(g.tensors, s.tensors, bounds, strict=True)):
            why = mismatch(a, b, t)
            if why is not None:
                self.diff(name, f"tensor {k}: {why}: gloo {_show(a)} | shardwire {_show(b)}")

    def diff(self, name: str, text: str) -> None:
        self.diffs.append(name)
        print(f"diff {name}: rank {self.rank}: {text}", flush=True)


def pairs(r: int, n: int) -> list[Pair]:
    limit = timedelta(seconds=60)
    world = Pair("world", dist.group.WORLD, dist.new_group(backend="shardwire", timeout=limit))
    rest = list(range(1, n))
    sub_gloo = dist.new_group(rest, backend="gloo", timeout=limit)
    sub_sw = dist.new_group(rest, backend="shardwire", timeout=limit)
    found = [world]
    if r in rest:
        found.append(Pair(f"ranks{rest}", sub_gloo, sub_sw))
    return found


def main() -> None:
    from conformance_cases import DTYPES, SOME_DTYPES, reductions
    from conformance_moves import movements

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    r = dist.get_rank()
    runner = Runner(r)
    # the world's calls wait at once, the subgroup's through their handles
    for k, pair in enumerate(pairs(r, dist.get_world_size())):
        dtypes = SOME_DTYPES if k else DTYPES
        reductions(runner, pair, dtypes, async_op=k == 1)
        movements(runner, pair, dtypes, async_op=k == 1)
    dist.barrier()
    dist.destroy_process_group()
    for name in runner.refused:
        print(f"refused {name}")
    for name in runner.extensions:
        print(f"extension {name}")
    print(
        f"checks {runner.checks} refused {len(runner.refused)} "
        f"extensions {len(runner.extensions)} diffs {len(runner.diffs)}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
