"""DiLoCo's outer state under live recovery: kept in each rank's memory at copy steps,
taken back by the outer group from its survivors, the same bits in every replica, an
exchange in flight included (its sent values: the replica's restored parameters).
Through real processes, with the inner copies: ``tests/e2e/test_live_recovery.py``."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.protocol.errors import InvalidState
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp.dilococopies import DiLoCoCopies, _outer_snapshot
from shardwire.worker.training.diloco import DiLoCo
from tests.worker.collectives.worlds import group_world, on_all
from tests.worker.training.test_diloco import Shards, _replicas, resume_and_compare

WORLD, STEPS, CUT = 3, 11, 6  # 6 is a sync step: with overlap, an exchange is in flight
OPTIONS = {"every": 3, "fragments": 3, "overlap": True, "quantize": "int8", "block": 4}


async def _kept(lost: set[int]) -> tuple[list[DiLoCoCopies], list[list[np.ndarray]]]:
    """Each rank's copies holding its outer state after step CUT (none for the ranks in
    ``lost``: replaced), and every replica's parameters then (what the inner copies give)."""
    copies = [DiLoCoCopies(CUT) for _ in range(WORLD)]
    async with group_world("memory", WORLD) as groups:
        outers = await _replicas(groups, CUT, **OPTIONS)
        snaps = await on_all(groups, lambda g: _outer_snapshot(outers[g.rank], CUT))
    for r, snap in enumerate(snaps):
        if r not in lost:
            copies[r]._outer[CUT] = snap
    assert snaps[0].meta["outer"]["flight"] is not None  # an exchange was in flight
    return copies, [[a.copy() for a in o.model.arrays] for o in outers]  # type: ignore[union-attr]


async def _new_generation(groups: list[Group], arrays: list[list[np.ndarray]]) -> list[DiLoCo]:
    """Each rank's DiLoCo of the next generation, begun, its model as the copies left it."""
    models = [Shards(r) for r in range(WORLD)]
    outers = [DiLoCo(m, g, **OPTIONS) for m, g in zip(models, groups, strict=True)]
    await on_all(groups, lambda g: outers[g.rank].begin())
    for model, kept in zip(models, arrays, strict=True):
        model.arrays = [a.copy() for a in kept]
    return outers


@pytest.mark.parametrize("lost", [set(), {1}, {0, 2}], ids=["none", "one", "two"])
async def test_the_survivors_outer_state_lets_every_replica_go_on_bit_for_bit(lost) -> None:
    async with group_world("memory", WORLD) as groups:
        straight = await _replicas(groups, STEPS, **OPTIONS)
    copies, arrays = await _kept(lost)
    async with group_world("memory", WORLD) as groups:
        outers = await _new_generation(groups, arrays)
        await on_all(groups, lambda g: copies[g.rank]._take_outer(outers[g.rank], CUT))
        await resume_and_compare(groups, outers, straight, CUT, STEPS)
    assert all(CUT in c._outer for c in copies)  # the replacements keep it now too


async def test_an_outer_state_nobody_kept_or_that_differs_is_refused_typed() -> None:
    copies, arrays = await _kept(set(range(WORLD)))
    async with group_world("memory", WORLD) as groups:
        outers = await _new_generation(groups, arrays)
        errors = await on_all(groups, lambda g: _raised(copies[g.rank], outers[g.rank]))
    assert errors[1].startswith("DiLoCo's outer state at step 6 is held by no rank of rank 1's")
    assert all("held by no rank" in e for e in errors), errors
    copies, arrays = await _kept(set())
    copies[2]._outer[CUT].meta["digest"] = "0" * 16  # as if its bytes differed
    async with group_world("memory", WORLD) as groups:
        outers = await _new_generation(groups, arrays)
        errors = await on_all(groups, lambda g: _raised(copies[g.rank], outers[g.rank]))
    assert all("differs between the ranks of" in e for e in errors), errors


async def _raised(copies: DiLoCoCopies, outer: DiLoCo) -> str:
    try:
        await copies._take_outer(outer, CUT)
    except InvalidState as exc:
        return str(exc)
    return "no error"


def test_save_and_restore_need_this_generation_s_diloco() -> None:
    with pytest.raises(InvalidState, match="bind"):
        DiLoCoCopies(5)._bound()
