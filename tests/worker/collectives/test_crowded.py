"""On a crowded node (more ranks than CPUs) a large broadcast takes the binomial tree."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.worker.collectives import ring, small

from .worlds import group_world, on_all


@pytest.mark.parametrize("crowded", [True, False])
async def test_the_crowded_flag_picks_the_broadcast(crowded: bool, monkeypatch) -> None:
    used: list[str] = []
    for module, name in [(ring, "broadcast_chain"), (small, "broadcast_tree")]:
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name):
            used.append(_name)
            return _original(*args)

        monkeypatch.setattr(module, name, spy)
    async with group_world("memory", 4) as groups:
        for g in groups:
            g.transport.topology.crowded = crowded
        data = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)

        async def call(g):
            x = data.copy() if g.rank == 1 else np.zeros_like(data)
            return await g.broadcast(x, root=1)

        results = await on_all(groups, call)
    for result in results:
        np.testing.assert_array_equal(result, data)
    assert set(used) == {"broadcast_tree" if crowded else "broadcast_chain"}
