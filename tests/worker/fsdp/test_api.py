"""Wrapper behaviour besides the training oracle: memory, checkpoints, misuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import (
    FSDP,
    FSDPConfig,
    FSDPError,
    MixedPrecision,
    Strategy,
    by_type,
    checkpoint,
)
from shardwire.worker.fsdp.unit import UnitState
from shardwire.worker.nn import Block, TransformerLM
from shardwire.worker.optim import AdamW
from tests.worker.transport.fabric import WORLDS

from .training import fsdp_world, make_model, reference, train_rank


async def test_full_shard_holds_a_quarter_of_no_shard_at_four_ranks() -> None:
    totals = {}
    for strategy in (Strategy.FULL_SHARD, Strategy.NO_SHARD):
        async with fsdp_world(4, strategy, "adamw") as ranks:
            await asyncio.gather(*(train_rank(f, r, 4) for r, f in enumerate(ranks)))
            stats = ranks[0].memory_stats()
            assert stats["held"] == stats["estimated"], strategy
            totals[strategy] = sum(stats["held"].values())
    assert totals[Strategy.FULL_SHARD] <= 0.30 * totals[Strategy.NO_SHARD]


async def test_sharded_state_from_four_ranks_loads_at_two_and_in_one_process() -> None:
    async with fsdp_world(4, Strategy.FULL_SHARD, "adamw") as ranks:
        await asyncio.gather(*(train_rank(f, r, 4) for r, f in enumerate(ranks)))
        pieces = [await f.state_dict(sharded=True) for f in ranks]
        trained = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
    async with fsdp_world(2, Strategy.FULL_SHARD, "adamw") as ranks:
        await asyncio.gather(*(f.load_state_dict(pieces) for f in ranks))
        states = await asyncio.gather(*(f.state_dict() for f in ranks))
    async with fsdp_world(1, Strategy.NO_SHARD, "adamw") as (single,):
        await single.load_state_dict(pieces)
        one = await single.state_dict()
    model = make_model()  # a plain single-process model takes the assembled state too
    for name, value in checkpoint.assemble(pieces).items():
        owner, _, local = name.rpartition(".")
        dict(model.named_modules())[owner].params[local][...] = value
    plain = dict(model.named_parameters())
    for state in (*states, one, plain):
        assert state.keys() == trained.keys()
        for name, value in trained.items():
            np.testing.assert_array_equal(state[name], value)
    want = reference("adamw")["params"]
    np.testing.assert_allclose(trained["head.weight"], want["head.weight"], rtol=1e-10)


async def test_models_that_differ_are_refused_naming_the_rank() -> None:
    async with WORLDS["memory"](3) as transports:
        groups = [Group(t) for t in transports]
        models = [make_model() for _ in range(3)]
        models[2] = TransformerLM(
            vocab=11, dim=8, heads=2, layers=2, context=6, rng=np.random.default_rng(1)
        )
        results = await asyncio.gather(
            *(
                FSDP.create(m, g, optimizer=AdamW(lr=0.1), policy=by_type(Block))
                for m, g in zip(models, groups, strict=True)
            ),
            return_exceptions=True,
        )
        for err in results:
            assert isinstance(err, FSDPError) and "rank(s) [2]" in str(err)


async def test_prefetch_misuse_is_explained() -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        for f in ranks:
            f.prefetch()
        with pytest.raises(FSDPError, match="twice without a forward"):
            ranks[0].prefetch()
        x = np.zeros((1, 3), np.int64)
        await asyncio.gather(*(f.forward(x) for f in ranks))
    async with fsdp_world(2, Strategy.NO_SHARD, "sgd") as ranks:
        with pytest.raises(FSDPError, match="NO_SHARD keeps full parameters"):
            ranks[0].prefetch()


async def test_full_shard_frees_gathered_parameters_after_use() -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        x = np.zeros((1, 3), np.int64)
        await asyncio.gather(*(f.forward(x) for f in ranks))
        states = ranks[0].unit_states()
        assert states["<root>"] is UnitState.FULL  # embeddings and head stay for backward
        assert all(s is UnitState.SHARDED for n, s in states.items() if n != "<root>")
        contexts = [f.full_params() for f in ranks]  # entered together: it gathers
        models = await asyncio.gather(*(c.__aenter__() for c in contexts))
        assert models[0].blocks[0].attn.qkv.params["weight"].shape == (24, 8)
        await asyncio.gather(*(c.__aexit__(None, None, None) for c in contexts))
        assert ranks[0].unit_states()["blocks.0"] is UnitState.SHARDED


async def test_prefetch_byte_budget_limits_gathers_in_flight() -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        for f in ranks:
            f.prefetch_depth = 3
            f.prefetch_bytes = ranks[0].units[0].gathered_bytes  # room for one unit
        for f in ranks:
            f.prefetch()
        states = ranks[0].unit_states()
        assert states["blocks.0"] is UnitState.GATHERING
        assert states["blocks.1"] is UnitState.SHARDED
        await asyncio.gather(*(u.gather() for f in ranks for u in (f.root, f.units[0])))


async def _train_float32(mixed: MixedPrecision | None) -> dict:
    async with WORLDS["memory"](2) as transports:
        groups = [Group(t) for t in transports]

        def model32():
            return TransformerLM(
                vocab=11,
                dim=8,
                heads=2,
                layers=3,
                context=6,
                rng=np.random.default_rng(42),
                dtype=np.float32,
            )

        ranks = await asyncio.gather(
            *(
                FSDP.create(
                    model32(),
                    g,
                    optimizer=AdamW(lr=0.01),
                    policy=by_type(Block),
                    mixed_precision=mixed or MixedPrecision(),
                )
                for g in groups
            )
        )
        await asyncio.gather(*(train_rank(f, r, 2) for r, f in enumerate(ranks)))
        return (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]


def _deviation(a: dict, b: dict) -> tuple[float, float]:
    d = np.concatenate([np.abs(a[n] - b[n]).ravel() for n in b])
    return float(d.mean()), float(d.max())


def _without_key_bias(state: dict, dim: int = 8) -> dict:
    """``state`` with the key part of every attention's qkv bias left out: adding a
    constant to a query's keys leaves its softmax unchanged, so that bias's exact
    gradient is zero and its float32 one rounding noise, which AdamW's normalised steps
    turn into moves of up to lr a step in either run."""
    out = dict(state)
    for n in state:
        if n.endswith("attn.qkv.bias"):
            out[n] = np.concatenate([state[n][:dim], state[n][2 * dim :]])
    return out


@pytest.mark.parametrize(
    ("mixed", "mean_bound", "max_bound"),
    [
        # float16 reductions only: every parameter within 2e-3 of the float32 run.
        (MixedPrecision(reduce_dtype=np.float16), 1e-4, 2e-3),
        # float16 parameters in the computation: on average within 1e-3; AdamW's
        # normalised steps let gradients near zero flip sign, so a few parameters move
        # by up to the full 5 steps x lr 0.01 = 0.05 away (measured: mean 3.5e-4, max 0.044).
        (MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float16), 1e-3, 0.05),
    ],
    ids=["reduce", "param+reduce"],
)
async def test_mixed_precision_stays_close_to_the_float32_run(mixed, mean_bound, max_bound) -> None:
    exact = await _train_float32(None)
    half = await _train_float32(mixed)
    mean, worst = _deviation(_without_key_bias(half), _without_key_bias(exact))
    assert 0 < mean <= mean_bound and worst <= max_bound, (mean, worst)
    assert _deviation(half, exact)[1] <= 5 * 0.01  # the key biases: 5 steps of lr
    assert all(half[n].dtype == np.float32 for n in half)  # master weights stay float32


async def test_sync_gradients_reduces_outside_gradients_like_backward() -> None:
    async with fsdp_world(2, Strategy.FULL_SHARD, "sgd") as ranks:
        grads = [{"head.weight": np.full((11, 8), r + 1.0)} for r in range(2)]
        await asyncio.gather(*(f.sync_gradients(g) for f, g in zip(ranks, grads, strict=True)))
        # the head lives in the root unit; its gradient is the sum 1 + 2 on every entry
        for f in ranks:
            head = next(e for e in f.root.layout.entries if e.name == "head.weight")
            lo, hi = f.root.layout.shard_range(f.group.rank)
            a, b = max(lo, head.offset), min(hi, head.offset + head.numel)
            np.testing.assert_array_equal(f.root.grad_shard[a - lo : b - lo], 3.0)


async def test_update_shards_checks_sizes() -> None:
    async with fsdp_world(2, Strategy.SHARD_GRAD_OP, "sgd") as ranks:
        with pytest.raises(InvalidArgument, match="expected 4 shards"):
            await ranks[0].update_shards([np.zeros(1)])
        bad = [s.copy() for s, _ in ranks[0].shards()]
        bad[1] = np.zeros(3)
        with pytest.raises(
            ValueError, match=r"unit blocks.0: expected a shard of \d+ values, got shape \(3,\)"
        ):
            await ranks[0].update_shards(bad)
        zeros = [[np.zeros_like(s) for s, _ in f.shards()] for f in ranks]
        await asyncio.gather(*(f.update_shards(z) for f, z in zip(ranks, zeros, strict=True)))
        weight = ranks[0].model.blocks[0].attn.qkv.params["weight"]
        assert weight.shape == (24, 8) and not weight.any()  # full params resynced


async def _gather_bytes(mixed: MixedPrecision) -> tuple[np.dtype, int]:
    """dtype of a gathered unit and the bytes rank 0 sent to gather it."""
    async with WORLDS["memory"](2) as transports:
        groups = [Group(t) for t in transports]
        ranks = await asyncio.gather(
            *(
                FSDP.create(
                    TransformerLM(
                        vocab=11,
                        dim=8,
                        heads=2,
                        layers=2,
                        context=6,
                        rng=np.random.default_rng(1),
                        dtype=np.float32,
                    ),
                    g,
                    optimizer=AdamW(lr=0.01),
                    policy=by_type(Block),
                    mixed_precision=mixed,
                )
                for g in groups
            )
        )
        before = transports[0].stats.bytes_sent
        await asyncio.gather(*(f.units[0].gather() for f in ranks))
        full = ranks[0].units[0].full
        assert full is not None
        return full.dtype, transports[0].stats.bytes_sent - before


async def test_param_dtype_gathers_in_that_dtype_with_half_the_bytes() -> None:
    dtype32, bytes32 = await _gather_bytes(MixedPrecision())
    dtype16, bytes16 = await _gather_bytes(MixedPrecision(param_dtype=np.float16))
    assert (dtype32, dtype16) == (np.float32, np.float16)
    assert bytes16 * 2 == bytes32
    exact = await _train_float32(None)
    half = await _train_float32(MixedPrecision(param_dtype=np.float16))
    mean, _worst = _deviation(half, exact)
    assert 0 < mean <= 1e-3  # float16 parameters in the computation change the result


async def test_hybrid_groups_are_closed_by_fsdp() -> None:
    async with fsdp_world(4, Strategy.HYBRID_SHARD, "sgd", shard_size=2) as ranks:
        transport = ranks[0].group.transport
        assert len(transport.groups) == 3  # the world, its shard group and replica group
        await ranks[0].aclose()
        assert list(transport.groups) == [ranks[0].group.group_id]


async def _no_shard(codec) -> dict:
    async with WORLDS["memory"](2) as transports:
        groups = [Group(t) for t in transports]
        ranks = await asyncio.gather(
            *(
                FSDP.create(
                    make_model(),
                    g,
                    optimizer=AdamW(lr=0.01),
                    strategy=Strategy.NO_SHARD,
                    policy=by_type(Block),
                    compression=codec,
                )
                for g in groups
            )
        )
        await asyncio.gather(*(train_rank(f, r, 2) for r, f in enumerate(ranks)))
        return (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]


async def test_no_shard_with_top_k_at_ratio_one_equals_no_compression() -> None:
    from shardwire.worker.training.compression import TopK

    plain = await _no_shard(None)
    same = await _no_shard(TopK(1.0))
    for name, value in plain.items():
        np.testing.assert_array_equal(same[name], value)
    sparse = await _no_shard(TopK(0.3))
    assert any(not np.array_equal(sparse[n], v) for n, v in plain.items())


def test_compression_is_for_no_shard_only() -> None:
    from shardwire.worker.training.compression import Float16

    with pytest.raises(InvalidArgument, match="compression works with NO_SHARD, not FULL_SHARD"):
        FSDPConfig(strategy=Strategy.FULL_SHARD, compression=Float16())
