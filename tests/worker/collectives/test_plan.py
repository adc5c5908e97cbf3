"""The algorithm thresholds, in one place."""

from __future__ import annotations

from shardwire.worker.collectives.plan import ALL_REDUCE_SMALL, EXCHANGE_SMALL, choose


def test_thresholds() -> None:
    assert choose("all_reduce", 100, 1) == "local"
    assert choose("all_reduce", ALL_REDUCE_SMALL, 4) == "doubling"
    assert choose("all_reduce", ALL_REDUCE_SMALL + 1, 4) == "ring"
    assert choose("reduce", ALL_REDUCE_SMALL, 4) == "tree"
    assert choose("all_gather", EXCHANGE_SMALL, 2) == "direct"
    assert choose("reduce_scatter", EXCHANGE_SMALL + 1, 2) == "ring"
    assert choose("broadcast", 1 << 20, 2) == "chain"
    assert choose("gather", 1 << 30, 2) == "direct"


def test_a_crowded_node_broadcasts_by_tree() -> None:
    assert choose("broadcast", 64 << 20, 4, crowded=True) == "tree"
    assert choose("broadcast", 64 << 20, 4, crowded=False) == "chain"
    assert choose("broadcast", 64 << 20, 4, nodes=True, crowded=True) == "tiers"
    assert choose("all_reduce", 64 << 20, 4, crowded=True) == "ring"
