"""Every collective against a numpy oracle, over the in-memory and the TCP transport.

Inputs are small integers stored in the tested dtype, so every reduction except AVG is
exact whatever the order, and results are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.worker.collectives import ReduceOp

from .worlds import KINDS, group_world, on_all

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
COUNTS = [0, 1, 7, 64, 1000]
LARGE = 300_007  # above every small-message threshold for 4-byte and wider dtypes
_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def valid_ops(dtype: str) -> list[ReduceOp]:
    kind = np.dtype(dtype).kind
    ops = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
    if kind == "f":
        ops.append(ReduceOp.AVG)
    else:
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops


def data(rank: int, count: int, dtype: str, salt: int = 0, shape_tail=()) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    low = 0 if np.dtype(dtype).kind in "ub" else -2
    values = rng.integers(low, 3, size=(count, *shape_tail))
    return values.astype(dtype)


def oracle(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stacked = np.stack(inputs)
    result = _UFUNC[op].reduce(stacked, axis=0, dtype=stacked.dtype)
    if op is ReduceOp.AVG:
        result = (result / len(inputs)).astype(stacked.dtype)
    return result


def check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype.kind == "f":
        np.testing.assert_allclose(
            got, want, rtol=2e-3 if want.dtype == np.float16 else 1e-6, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
async def test_all_reduce_every_dtype_op_and_size(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        cases = [(c, d, op) for d in DTYPES for c in COUNTS for op in valid_ops(d)]
        cases += [(LARGE, d, op) for d in ("float32", "int64") for op in valid_ops(d)[:3]]
        for salt, (count, dtype, op) in enumerate(cases):
            inputs = [data(r, count, dtype, salt) for r in range(n)]
            want = oracle(inputs, op)
            outs = await on_all(groups, lambda g: g.all_reduce(inputs[g.rank].copy(), op))
            for rank, got in enumerate(outs):
                check(got, want, f"{kind} n={n} all_reduce {dtype}[{count}] {op} rank {rank}")
            if n > 1:  # every rank holds the very same bits
                assert all(o.tobytes() == outs[0].tobytes() for o in outs)


def prefixes(inputs: list[np.ndarray], op: ReduceOp) -> list[np.ndarray]:
    """What a scan gives each rank: the oracle's reduction of ranks 0..r."""
    return [oracle(inputs[: r + 1], op) for r in range(len(inputs))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
async def test_scan_every_dtype_op_and_size(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        cases = [(c, d, op) for d in DTYPES for c in (0, 1, 1000) for op in valid_ops(d)]
        cases += [(LARGE, "float32", ReduceOp.SUM), (LARGE, "int64", ReduceOp.MAX)]
        for salt, (count, dtype, op) in enumerate(cases):
            inputs = [data(r, count, dtype, salt) for r in range(n)]
            outs = await on_all(groups, lambda g: g.scan(inputs[g.rank].copy(), op))
            for rank, (got, want) in enumerate(zip(outs, prefixes(inputs, op), strict=True)):
                check(got, want, f"{kind} n={n} scan {dtype}[{count}] {op} rank {rank}")


@pytest.mark.parametrize("kind", KINDS)
async def test_scan_into_out_keeps_the_input_and_keeps_its_shape(kind: str) -> None:
    async with group_world(kind, 3) as groups:
        inputs = [data(r, 12, "int32", 4).reshape(3, 4) for r in range(3)]
        kept = [x.copy() for x in inputs]
        outs = [np.empty((3, 4), np.int32) for _ in range(3)]
        got = await on_all(groups, lambda g: g.scan(inputs[g.rank], "max", out=outs[g.rank]))
        for r, want in enumerate(prefixes(inputs, ReduceOp.MAX)):
            assert got[r] is outs[r]
            check(got[r], want, f"{kind} scan into out, rank {r}")
            np.testing.assert_array_equal(inputs[r], kept[r])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_reduce_scatter_equal_and_explicit_sizes(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        for salt, (rows, sizes) in enumerate(
            [
                (n * 3, None),
                (n * (LARGE // 50), None),
                (0, None),
                (sum(range(n + 1)), list(range(1, n + 1))),
            ]
        ):
            inputs = [data(r, rows, "float32", salt, (5,)) for r in range(n)]
            full = oracle(inputs, ReduceOp.SUM)
            cut = np.cumsum([0, *(sizes or [rows // n] * n)])
            outs = await on_all(groups, lambda g: g.reduce_scatter(inputs[g.rank], sizes=sizes))
            for r, got in enumerate(outs):
                check(got, full[cut[r] : cut[r + 1]], f"{kind} n={n} rows={rows} rank {r}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
async def test_all_gather_equal_uneven_and_large(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        for salt, sizes in enumerate(
            [[4] * n, [0] * n, [r % 3 for r in range(n)], [LARGE // 10] * n]
        ):
            inputs = [data(r, sizes[r], "int32", salt, (3,)) for r in range(n)]
            want = np.concatenate(inputs)
            outs = await on_all(groups, lambda g: g.all_gather(inputs[g.rank], sizes=sizes))
            for r, got in enumerate(outs):
                check(got, want, f"{kind} n={n} sizes={sizes} rank {r}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_broadcast_small_and_large_from_every_root(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        for count in (0, 5, 1 << 17):
            for root in range(n):
                src = data(root, count, "float64", root)
                bufs = [src.copy() if r == root else np.zeros_like(src) for r in range(n)]
                outs = await on_all(groups, lambda g: g.broadcast(bufs[g.rank], root=root))
                for r, got in enumerate(outs):
                    assert got is bufs[r]
                    check(got, src, f"{kind} n={n} count={count} root={root} rank {r}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_reduce_to_every_root(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        for count in (7, LARGE // 4):
            for root in range(n):
                inputs = [data(r, count, "int64", root) for r in range(n)]
                copies = [x.copy() for x in inputs]
                want = oracle(inputs, ReduceOp.MAX)
                outs = await on_all(groups, lambda g: g.reduce(copies[g.rank], "max", root=root))
                for r, got in enumerate(outs):
                    if r == root:
                        check(got, want, f"{kind} n={n} root={root}")
                    else:
                        assert got is None
                        np.testing.assert_array_equal(copies[r], inputs[r])  # untouched


async def gather_and_scatter(groups, parts: list[np.ndarray], root: int, sizes: list[int]):
    """Gather ``parts`` (rank r's rows, ``sizes[r]`` of them) to ``root`` and scatter them
    back from it, each against the oracle."""
    outs = await on_all(groups, lambda g: g.gather(parts[g.rank], root=root, sizes=sizes))
    check(outs[root], np.concatenate(parts), f"gather root={root} sizes={sizes}")
    assert all(got is None for r, got in enumerate(outs) if r != root)
    full = np.concatenate(parts)
    outs = await on_all(
        groups, lambda g: g.scatter(full if g.rank == root else None, root=root, sizes=sizes)
    )
    for r, got in enumerate(outs):
        check(got, parts[r], f"scatter root={root} sizes={sizes} rank {r}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_gather_and_scatter(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        sizes = [r + 1 for r in range(n)]
        inputs = [data(r, sizes[r], "uint8", 7, (2,)) for r in range(n)]
        for root in range(n):
            await gather_and_scatter(groups, inputs, root, sizes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_all_to_all_equal_and_split(kind: str, n: int) -> None:
    async with group_world(kind, n) as groups:
        inputs = [data(r, 2 * n, "int16", r, (3,)) for r in range(n)]
        outs = await on_all(groups, lambda g: g.all_to_all(inputs[g.rank]))
        for r, got in enumerate(outs):
            want = np.concatenate([inputs[s][2 * r : 2 * r + 2] for s in range(n)])
            check(got, want, f"all_to_all rank {r}")
        # rank s sends (s + p) % 3 rows to rank p
        splits = [[(s + p) % 3 for p in range(n)] for s in range(n)]
        parts = [data(s, sum(splits[s]), "float32", 9) for s in range(n)]
        cuts = [np.cumsum([0, *splits[s]]) for s in range(n)]

        def run(g):
            recv = [splits[s][g.rank] for s in range(n)]
            return g.all_to_all(
                parts[g.rank], send_splits=splits[g.rank], recv_splits=recv if g.rank % 2 else None
            )

        outs = await on_all(groups, run)
        for r, got in enumerate(outs):
            want = np.concatenate([parts[s][cuts[s][r] : cuts[s][r + 1]] for s in range(n)])
            check(got, want, f"all_to_all splits rank {r}")


@pytest.mark.parametrize("kind", KINDS)
async def test_barrier_objects_and_point_to_point(kind: str) -> None:
    async with group_world(kind, 3) as groups:
        await on_all(groups, lambda g: g.barrier())
        got = await on_all(
            groups,
            lambda g: g.broadcast_object(
                {"lr": 0.1, "layers": [1, 2]} if g.rank == 1 else None, root=1
            ),
        )
        assert got == [{"lr": 0.1, "layers": [1, 2]}] * 3
        got = await on_all(groups, lambda g: g.all_gather_object(f"rank-{g.rank}"))
        assert got == [["rank-0", "rank-1", "rank-2"]] * 3
        got = await on_all(groups, lambda g: g.gather_object({"r": g.rank}, root=2))
        assert got == [None, None, [{"r": 0}, {"r": 1}, {"r": 2}]]

        async def ping(g):
            if g.rank == 0:
                await g.send(np.arange(3), 2, tag=5)
                return None
            if g.rank == 2:
                return (await g.recv(0, tag=5)).tolist()
            return None

        assert (await on_all(groups, ping))[2] == [0, 1, 2]


@pytest.mark.parametrize("kind", KINDS)
async def test_results_are_deterministic_across_runs(kind: str) -> None:
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(5000).astype(np.float32) for _ in range(5)]
    runs = []
    for _ in range(2):
        async with group_world(kind, 5) as groups:
            outs = await on_all(groups, lambda g: g.all_reduce(inputs[g.rank].copy()))
            big = [np.tile(x, 60) for x in inputs]  # ring path
            outs += await on_all(groups, lambda g: g.all_reduce(big[g.rank]))
            runs.append([o.tobytes() for o in outs])
    assert runs[0] == runs[1]
    assert len(set(runs[0][:5])) == 1 and len(set(runs[0][5:])) == 1
