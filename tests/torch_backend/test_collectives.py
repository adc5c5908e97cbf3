"""Every c10d collective over the shardwire backend, against numpy, for every way torch
starts a group."""

from __future__ import annotations

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from .spawn import run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _checks(outs: list[str]) -> list[int]:
    return [
        int(line.split()[1])
        for out in outs
        for line in out.splitlines()
        if line.startswith("checks ")
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_matches_numpy(n, tmp_path):
    ranks = run_ranks(n, "collectives.py", "env", tmp=tmp_path).check()
    counts = _checks(ranks.outs)
    assert len(counts) == n and min(counts) >= 40, counts


@pytest.mark.parametrize("init", ["tcp", "file", "store", "cpu"])
def test_every_init_method_forms_the_group(init, tmp_path):
    arg = f"file:{tmp_path / 'rendezvous'}" if init == "file" else init
    ranks = run_ranks(2, "collectives.py", arg, tmp=tmp_path).check()
    assert len(_checks(ranks.outs)) == 2
