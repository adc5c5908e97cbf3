"""Aggregators against a numpy average of the ranks' gradients, parameter-server training
against all-reduce training (float64, 1e-10), and compression: top-k at ratio 1 equals
no compression exactly, its residual bookkeeping matches numpy, float16 sums in float32."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.worker.nn import Linear, ReLU, Sequential, mse
from shardwire.worker.optim import SGD
from shardwire.worker.training.aggregation import (
    AggregationError,
    AllReduceAggregator,
    LocalAggregator,
    ParameterServer,
    distributed_train_step,
)
from shardwire.worker.training.compression import Float16, TopK
from tests.worker.collectives.worlds import KINDS, group_world, on_all


def _grads(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal((3, 4)), rng.standard_normal(5)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "make",
    [
        AllReduceAggregator,
        lambda g: ParameterServer(g, server=0),
        lambda g: ParameterServer(g, server=2),
    ],
    ids=["allreduce", "ps-0", "ps-2"],
)
async def test_aggregators_average_like_numpy(kind: str, make) -> None:
    want = [np.mean([_grads(r)[i] for r in range(3)], axis=0) for i in range(2)]
    async with group_world(kind, 3) as groups:
        aggs = [make(g) for g in groups]
        results = await on_all(groups, lambda g: aggs[g.rank].aggregate(_grads(g.rank)))
    for result in results:
        for got, expected in zip(result, want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-12)


async def test_a_local_aggregator_is_for_one_process() -> None:
    async with group_world("memory", 2) as groups:
        with pytest.raises(AggregationError, match="single process"):
            LocalAggregator(groups[0])
    grads = _grads(0)
    out = await LocalAggregator().aggregate(grads)
    assert all(np.array_equal(a, b) and a is not b for a, b in zip(out, grads, strict=True))


async def test_mismatched_gradient_lists_are_refused_on_every_rank_naming_the_rank() -> None:
    async with group_world("memory", 3) as groups:
        aggs = [AllReduceAggregator(g) for g in groups]
        results = await asyncio.gather(
            aggs[0].aggregate(_grads(0)),
            aggs[1].aggregate(_grads(1)),
            aggs[2].aggregate(_grads(2)[:1]),
            return_exceptions=True,
        )
    assert all(isinstance(r, AggregationError) and "ranks [2] bring" in str(r) for r in results)


async def test_ranks_differing_from_rank_0_are_named_the_same_everywhere() -> None:
    from shardwire.worker.collectives.agree import SHOWN, differing_from_root

    async with group_world("memory", 20) as groups:
        got = await on_all(groups, lambda g: differing_from_root(g, (1, 2) if g.rank < 2 else [3]))
    assert got == [(list(range(2, 2 + SHOWN)), 18)] * 20
    async with group_world("memory", 3) as groups:  # a tuple and a list are alike
        got = await on_all(groups, lambda g: differing_from_root(g, (1, 2) if g.rank else [1, 2]))
    assert got == [([], 0)] * 3


def _model() -> Sequential:
    rng = np.random.default_rng(9)
    return Sequential(Linear(4, 6, rng=rng), ReLU(), Linear(6, 2, rng=rng))


def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return rng.standard_normal((5, 4)), rng.standard_normal((5, 2))


async def _train(kind: str, world: int, make, *, steps: int = 3, batches=None) -> list:
    batches = batches or _batch
    async with group_world(kind, world) as groups:
        models = [_model() for _ in groups]
        aggs = [make(g) for g in groups]
        opts = [SGD(lr=0.1, momentum=0.9) for _ in groups]
        for step in range(steps):
            await asyncio.gather(
                *(
                    distributed_train_step(models[r], batches(r, step), mse, aggs[r], opts[r])
                    for r in range(world)
                )
            )
    return [[p.copy() for _, p in m.named_parameters()] for m in models]


@pytest.mark.parametrize("kind", KINDS)
async def test_parameter_server_training_equals_all_reduce_training(kind: str) -> None:
    ring = await _train(kind, 3, AllReduceAggregator)
    server = await _train(kind, 3, lambda g: ParameterServer(g, server=1))
    for a, b in zip(ring[0], server[0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    for rank in server:  # every rank holds the same parameters
        for a, b in zip(rank, server[0], strict=True):
            np.testing.assert_array_equal(a, b)


async def test_a_dedicated_server_holds_the_optimizer() -> None:
    workers = await _train("memory", 2, AllReduceAggregator)
    # rank 0 serves; ranks 1 and 2 train on the batches ranks 0 and 1 had above
    served = await _train(
        "memory",
        3,
        lambda g: ParameterServer(g, server=0, dedicated=True),
        batches=lambda rank, step: None if rank == 0 else _batch(rank - 1, step),
    )
    for rank in served:
        for a, b in zip(rank, workers[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10)


async def test_top_k_at_ratio_one_is_exactly_no_compression() -> None:
    plain = await _train("memory", 2, AllReduceAggregator, steps=4)
    topk = await _train("memory", 2, lambda g: AllReduceAggregator(g, codec=TopK(1.0)), steps=4)
    for a, b in zip(plain[0], topk[0], strict=True):
        np.testing.assert_array_equal(a, b)


def test_top_k_residuals_follow_the_numpy_reference() -> None:
    codec = TopK(0.25)
    residual = np.zeros(8)
    rng = np.random.default_rng(0)
    for _ in range(4):
        grad = rng.standard_normal(8)
        corrected = grad + residual
        keep = np.sort(np.argsort(-np.abs(corrected))[:2])
        indices, values = codec.select(0, grad)
        np.testing.assert_array_equal(indices, keep)
        np.testing.assert_array_equal(values, corrected[keep])
        residual = corrected.copy()
        residual[keep] = 0.0
        np.testing.assert_array_equal(codec.residuals[0], residual)


async def test_top_k_sums_the_sparse_parts_and_float16_sums_in_float32() -> None:
    async with group_world("memory", 3) as groups:
        grads = [np.random.default_rng(r).standard_normal(40) for r in range(3)]
        codecs = [TopK(0.1) for _ in groups]
        sparse = await on_all(groups, lambda g: codecs[g.rank].sum(g, 0, grads[g.rank]))
        halves = await on_all(groups, lambda g: Float16().sum(g, 0, grads[g.rank]))
    expected = np.zeros(40)
    for g in grads:
        keep = np.argsort(-np.abs(g))[:4]
        expected[keep] += g[keep]
    for s in sparse:
        np.testing.assert_allclose(s, expected, rtol=1e-12)
    f16 = sum(g.astype(np.float16).astype(np.float32) for g in grads)
    for h in halves:
        np.testing.assert_allclose(h, f16, rtol=1e-6)
