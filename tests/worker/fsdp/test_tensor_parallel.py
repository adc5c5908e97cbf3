"""2-D parallelism: tensor parallel inside pairs of ranks, FSDP across them (a 2 x 2 mesh on
4 ranks), trained for several AdamW steps, equals single-process training."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, Strategy
from shardwire.worker.fsdp.strategy import by_type
from shardwire.worker.nn import TransformerLM
from shardwire.worker.nn.parallel import ParallelBlock
from tests.worker.transport.fabric import WORLDS

from .training import assert_follows_oracle, make_optimizer, reference, train_rank


@pytest.mark.parametrize("strategy", [Strategy.FULL_SHARD, Strategy.NO_SHARD])
async def test_tensor_parallel_times_fsdp_equals_one_process(strategy: Strategy) -> None:
    async with WORLDS["memory"](4, timeout=60) as transports:
        worlds = [Group(t, timeout=60) for t in transports]
        tps = [w.new_group([0, 1] if w.rank < 2 else [2, 3], name="tp") for w in worlds]
        dps = [w.new_group([w.rank % 2, w.rank % 2 + 2], name="dp") for w in worlds]
        models = [
            TransformerLM(
                vocab=11,
                dim=8,
                heads=2,
                layers=3,
                context=6,
                rng=np.random.default_rng(42),
                block=functools.partial(ParallelBlock, group=tp),
            )
            for tp in tps
        ]
        ranks = await asyncio.gather(
            *(
                FSDP.create(
                    m,
                    dp,
                    optimizer=make_optimizer("adam"),
                    strategy=strategy,
                    policy=by_type(ParallelBlock),
                )
                for m, dp in zip(models, dps, strict=True)
            )
        )
        try:
            await asyncio.gather(
                *(train_rank(f, dp.rank, 2) for f, dp in zip(ranks, dps, strict=True))
            )
            states = await asyncio.gather(*(f.state_dict() for f in ranks))
        finally:
            for f in ranks:
                await f.aclose()
            for w in worlds:
                await w.aclose()
    assert_follows_oracle(models, states, reference("adam")["params"])
