"""N-rank FSDP training equals single-process training on the same global batch."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.worker.fsdp import Strategy

from .training import fsdp_world, reference, train_rank

TRANSPORTS = ["memory", "tcp"]
CASES = [
    (Strategy.FULL_SHARD, 1, None),
    (Strategy.FULL_SHARD, 2, None),
    (Strategy.FULL_SHARD, 3, None),
    (Strategy.FULL_SHARD, 4, None),
    (Strategy.SHARD_GRAD_OP, 2, None),
    (Strategy.SHARD_GRAD_OP, 3, None),
    (Strategy.SHARD_GRAD_OP, 4, None),
    (Strategy.NO_SHARD, 1, None),
    (Strategy.NO_SHARD, 2, None),
    (Strategy.NO_SHARD, 3, None),
    (Strategy.NO_SHARD, 4, None),
    (Strategy.HYBRID_SHARD, 4, 2),
    (Strategy.HYBRID_SHARD, 2, 1),
]


def assert_same(got: dict, want: dict) -> None:
    # atol: some parameters have an exactly zero true gradient (the key bias: softmax is
    # shift-invariant), where AdamW turns 1e-17 summation noise into ~1e-12 moves.
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize(("strategy", "world", "shard_size"), CASES)
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_matches_single_process(
    strategy, world, shard_size, kind, prefetch, transport
) -> None:
    want = reference(kind)
    async with fsdp_world(
        world, strategy, kind, shard_size=shard_size, prefetch=prefetch, transport=transport
    ) as ranks:
        await asyncio.gather(*(train_rank(f, r, world) for r, f in enumerate(ranks)))
        states = await asyncio.gather(*(f.state_dict() for f in ranks))
    for state in states:
        assert_same(state, want["params"])


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_no_sync_accumulation(strategy, prefetch, transport) -> None:
    world, shard = (4, 2) if strategy is Strategy.HYBRID_SHARD else (2, None)
    want = reference("adamw", micro=2)
    async with fsdp_world(
        world, strategy, "adamw", prefetch=prefetch, shard_size=shard, transport=transport
    ) as ranks:
        await asyncio.gather(*(train_rank(f, r, world, micro=2) for r, f in enumerate(ranks)))
        states = await asyncio.gather(*(f.state_dict() for f in ranks))
    for state in states:
        assert_same(state, want["params"])


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_clip_grad_norm_is_the_global_norm(strategy, transport) -> None:
    world, shard = (4, 2) if strategy is Strategy.HYBRID_SHARD else (3, None)
    want = reference("sgd", clip=0.05)
    async with fsdp_world(world, strategy, "sgd", shard_size=shard, transport=transport) as ranks:
        norms = await asyncio.gather(
            *(train_rank(f, r, world, clip=0.05) for r, f in enumerate(ranks))
        )
        states = await asyncio.gather(*(f.state_dict() for f in ranks))
    for got in norms:
        np.testing.assert_allclose(got, want["norms"], rtol=1e-10)
    assert max(want["norms"]) > 0.05  # clipping actually happened
    assert_same(states[0], want["params"])
