"""Collectives over nodes of different sizes: node leaders cross between nodes, the rest
goes through each node's arena. Results against numpy, nothing but the leaders crossing
nodes, nothing moved by message inside a node, and call order under concurrency.

Nodes are simulated by roster node ids (a node arena inside each node, TCP across).
"""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.protocol import CollectiveMismatch, CollectiveTimeout
from shardwire.worker.backends.leaders import Leaders
from shardwire.worker.collectives import Group, ReduceOp

from .test_nodes import across, checked_all_reduces, node_world
from .test_oracle import check, data, oracle
from .worlds import on_all

# node of each rank: 3+1, 1+2, interleaved 2+3, and three nodes of 3, 2 and 1
LAYOUTS = {
    "3+1": [0, 0, 0, 1],
    "1+2": [0, 1, 1],
    "2+3": [0, 1, 0, 1, 1],
    "3+2+1": [0, 0, 1, 0, 1, 2],
}
COUNT = 200_003


def leaders(nodes: list[int]) -> set[int]:
    return {nodes.index(n) for n in set(nodes)}


def crossed_only_by_leaders(nodes: list[int], sent: list[list]) -> None:
    for r in range(len(nodes)):
        inside = [dst for dst, _ in sent[r] if nodes[dst] == nodes[r]]
        assert inside == [], f"rank {r} sent by message inside its node"
        if r not in leaders(nodes):
            assert across(nodes, sent, r) == 0, f"rank {r} is no leader but crossed nodes"


async def _open(groups: list[Group]) -> None:
    """One call to open every node's arena (its opening exchange goes by message)."""
    await on_all(groups, lambda g: g.barrier())
    await on_all(groups, lambda g: g.all_reduce(np.ones(4)))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
async def test_all_reduce_goes_through_the_leaders(name: str) -> None:
    nodes = LAYOUTS[name]
    async with node_world(nodes) as (groups, sent):
        assert all(isinstance(g.backend, Leaders) for g in groups)
        await _open(groups)
        cases = [("float32", ReduceOp.SUM), ("float64", ReduceOp.AVG), ("int64", ReduceOp.MAX)]
        async for _first in checked_all_reduces(name, groups, sent, cases, COUNT):
            crossed_only_by_leaders(nodes, sent)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
async def test_reduce_scatter_and_all_gather_through_the_leaders(name: str) -> None:
    nodes = LAYOUTS[name]
    n = len(nodes)
    sizes = [COUNT // n + 5 * r for r in range(n)]  # uneven parts
    async with node_world(nodes) as (groups, sent):
        await _open(groups)
        for log in sent:
            log.clear()
        inputs = [data(r, sum(sizes), "float32", 7) for r in range(n)]
        outs = await on_all(
            groups, lambda g: g.reduce_scatter(inputs[g.rank], ReduceOp.AVG, sizes=sizes)
        )
        want = oracle(inputs, ReduceOp.AVG)
        cut = np.cumsum([0, *sizes])
        for r, got in enumerate(outs):
            check(got, want[cut[r] : cut[r + 1]], f"{name} reduce_scatter rank {r}")
        parts = [data(r, sizes[r], "int32", 9) for r in range(n)]
        outs = await on_all(groups, lambda g: g.all_gather(parts[g.rank], sizes=sizes))
        for r, got in enumerate(outs):
            check(got, np.concatenate(parts), f"{name} all_gather rank {r}")
        crossed_only_by_leaders(nodes, sent)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
async def test_broadcast_from_every_rank(name: str) -> None:
    nodes = LAYOUTS[name]
    n = len(nodes)
    async with node_world(nodes) as (groups, sent):
        await _open(groups)
        for root in range(n):
            for log in sent:
                log.clear()
            x = data(root, 50_000, "float32", 11 + root)
            bufs = [x.copy() if r == root else np.zeros_like(x) for r in range(n)]
            outs = await on_all(groups, lambda g: g.broadcast(bufs[g.rank], root=root))
            for r, got in enumerate(outs):
                check(got, x, f"{name} broadcast root {root} rank {r}")
            crossed_only_by_leaders(nodes, sent)


@pytest.mark.parametrize("nodes", [[0, 0, 1, 1], [0, 0, 0, 1, 1]], ids=["lanes", "leaders"])
async def test_phases_name_the_silent_rank_and_the_calls_the_user_made(nodes) -> None:
    silent = len(nodes) - 1  # a rank of the last node never makes the call
    async with node_world(nodes) as (groups, _sent):
        await _open(groups)

        async def call(g: Group):
            if g.rank == silent:
                return None
            with pytest.raises(CollectiveTimeout) as info:
                await g.all_reduce(np.ones(10), timeout=1.0)
            return str(info.value)

        texts = await on_all(groups, call)
        for r, text in enumerate(texts[:silent]):
            assert "not heard from ranks [" in text, (r, text)
        assert f"not heard from ranks [{silent}]" in texts[silent - 1]  # its node peer

    async with node_world(nodes) as (groups, _sent):
        await _open(groups)

        async def differ(g: Group):
            pending = g.all_gather(np.ones(10)) if g.rank == silent else g.all_reduce(np.ones(10))
            with pytest.raises(CollectiveMismatch) as info:
                await pending
            return str(info.value)

        text = " ".join(await on_all(groups, differ))
        assert "all_reduce:float64:10:sum" in text and "all_gather:float64" in text
