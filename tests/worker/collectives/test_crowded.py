"""On a crowded node (more ranks than CPUs) a large broadcast takes the binomial tree."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from .worlds import group_world


@pytest.mark.parametrize("crowded", [True, False])
async def test_the_crowded_flag_picks_the_broadcast(crowded: bool) -> None:
    async with group_world("memory", 4) as groups:
        for g in groups:
            g.transport.topology.crowded = crowded
        data = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
        calls = [
            g.broadcast(data.copy() if g.rank == 1 else np.zeros_like(data), root=1) for g in groups
        ]
        results = await asyncio.gather(*calls)
    for result in results:
        np.testing.assert_array_equal(result, data)
    assert {str(c.decision) for c in calls} == {"links/tree" if crowded else "links/chain"}
