"""The gradient lifecycle of units, the compute-thread bridge, HYBRID_SHARD's replica
all-reduces running together, and the bound on reductions in flight."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.collectives import Work
from shardwire.worker.fsdp import FSDPConfig, Strategy
from shardwire.worker.fsdp.unit import GradState, Unit
from shardwire.worker.nn import softmax_cross_entropy

from .training import GLOBAL_BATCH, SEQ, batch, fsdp_world


async def _backward(f, rank: int, world: int) -> None:
    ids, targets = batch(0)
    rows = np.array_split(np.arange(GLOBAL_BATCH), world)[rank]
    logits = await f.forward(ids[rows])
    _, dlogits = softmax_cross_entropy(logits, targets[rows], denom=GLOBAL_BATCH * SEQ)
    await f.backward(dlogits)


async def test_gradients_move_idle_accumulating_idle() -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        assert {u.grad_state for f in ranks for u in f.all_units()} == {GradState.IDLE}

        async def accumulate(f, rank: int) -> None:
            with f.no_sync():
                await _backward(f, rank, 2)

        await asyncio.gather(*(accumulate(f, r) for r, f in enumerate(ranks)))
        states = {u.grad_state for f in ranks for u in f.all_units()}
        assert states == {GradState.ACCUMULATING}  # kept for the next synced backward
        assert not any(u.grad_shard.any() for f in ranks for u in f.all_units())
        await asyncio.gather(*(_backward(f, r, 2) for r, f in enumerate(ranks)))
        assert {u.grad_state for f in ranks for u in f.all_units()} == {GradState.IDLE}
        assert all(u.grad_full is None for f in ranks for u in f.all_units())
        assert any(u.grad_shard.any() for f in ranks for u in f.all_units())


async def test_an_error_in_a_posted_hook_reaches_the_caller(monkeypatch) -> None:
    async with fsdp_world(1, Strategy.FULL_SHARD, "sgd") as ranks:
        f = ranks[0]

        def broken(grad: np.ndarray) -> None:
            raise RuntimeError(f"reduction of {grad.size} elements refused")

        # raised inside the hook a unit's backward posts to start its reduction
        monkeypatch.setattr(f.shard_group, "reduce_scatter", broken)
        with pytest.raises(RuntimeError, match="refused"):
            await _backward(f, 0, 1)


async def test_hybrid_replica_all_reduces_run_together(monkeypatch) -> None:
    async with fsdp_world(4, Strategy.HYBRID_SHARD, "sgd", shard_size=2) as ranks:
        replica = ranks[0].replica_group
        assert replica is not None
        started = 0
        seen_at_first_result: list[int] = []
        all_reduce, finish_reduce = replica.all_reduce, Unit.finish_reduce

        def counting(*args, **kwargs):
            nonlocal started
            started += 1
            return all_reduce(*args, **kwargs)

        def recording(unit: Unit, reduced: np.ndarray) -> None:
            if unit.replica_group is replica and not seen_at_first_result:
                seen_at_first_result.append(started)
            finish_reduce(unit, reduced)

        monkeypatch.setattr(replica, "all_reduce", counting)
        monkeypatch.setattr(Unit, "finish_reduce", recording)
        await asyncio.gather(*(_backward(f, r, 4) for r, f in enumerate(ranks)))
        # Every unit's replica all-reduce was under way before the first result was used.
        assert seen_at_first_result == [len(ranks[0].all_units())]


def _slow_reductions(group, monkeypatch, delay: float = 0.05) -> list[int]:
    """Make every reduce-scatter of ``group`` take ``delay`` seconds before it starts. Returns
    [reductions under way now, the most under way at once]."""
    real = group.reduce_scatter
    flight = [0, 0]

    class Slow:
        def __init__(self, x: np.ndarray) -> None:
            self.x = x

        def start(self) -> Work:
            flight[0] += 1
            flight[1] = max(flight)

            async def run() -> np.ndarray:
                try:
                    await asyncio.sleep(delay)
                    return await real(self.x)
                finally:
                    flight[0] -= 1

            return Work(asyncio.ensure_future(run()))

    monkeypatch.setattr(group, "reduce_scatter", Slow)
    return flight


@pytest.mark.parametrize("depth", [None, 1, 2])
async def test_reduce_depth_bounds_the_reductions_in_flight(depth, monkeypatch) -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd", reduce_depth=depth) as ranks:
        flights = [_slow_reductions(f.shard_group, monkeypatch) for f in ranks]
        await asyncio.gather(*(_backward(f, r, 2) for r, f in enumerate(ranks)))
        units = len(ranks[0].all_units())
        assert [most for _now, most in flights] == [units if depth is None else depth] * 2
        assert {u.grad_state for f in ranks for u in f.all_units()} == {GradState.IDLE}


def test_reduce_depth_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="reduce_depth"):
        FSDPConfig(reduce_depth=0)


async def test_gather_wait_counts_all_gathers_and_hook_wait_everything(monkeypatch) -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd", reduce_depth=1) as ranks:
        for f in ranks:
            _slow_reductions(f.shard_group, monkeypatch, delay=0.25)
        await asyncio.gather(*(_backward(f, r, 2) for r, f in enumerate(ranks)))
        units = len(ranks[0].all_units())
        for f in ranks:
            # the hooks of the inner units' backward each waited for the reduction before
            # theirs, launched 0.25 s before it ends: time blocked in hooks, not waiting
            # for parameters (half of it as the bound: the compute between a reduction's
            # launch and the next hook's wait for it, slower under load, is not waited)
            assert f.hook_wait_s >= f.gather_wait_s + 0.125 * (units - 2)
            assert 0 < f.gather_wait_s < 0.25


async def test_no_shard_never_waits_for_an_all_gather() -> None:
    async with fsdp_world(2, Strategy.NO_SHARD, "sgd") as ranks:
        await asyncio.gather(*(_backward(f, r, 2) for r, f in enumerate(ranks)))
        assert [f.gather_wait_s for f in ranks] == [0.0, 0.0]
        assert all(f.hook_wait_s > 0 for f in ranks)  # its gradient all-reduces
