"""Rank sets as runs: the layouts of real groups fold to one run, anything folds back."""

from __future__ import annotations

import random

from shardwire.protocol.ranks import from_runs, to_runs


def test_real_group_layouts_are_one_run() -> None:
    assert to_runs(range(1000)) == [(0, 1000, 1)]
    assert to_runs(range(16, 32)) == [(16, 32, 1)]  # a node
    assert to_runs(range(5, 4096, 8)) == [(5, 4094, 8)]  # a lane (stop: the last + 1)
    assert to_runs([7]) == [(7, 8, 1)]
    assert to_runs([]) == []


def test_any_set_folds_back_and_too_irregular_ones_are_none() -> None:
    rng = random.Random(3)
    for _ in range(200):
        ranks = rng.sample(range(300), rng.randint(1, 60))
        runs = to_runs(ranks, limit=64)
        assert runs is not None and from_runs(runs) == sorted(ranks)
    assert to_runs([r * r for r in range(100)]) is None
