"""Time spent waiting for collectives: overlapping and nested waits count once, a call
that already ended costs nothing, and a real awaited call is counted."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.worker.observe.waits import WAITS, Waits

from .worlds import KINDS, group_world, on_all


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_and_nested_waits_count_once() -> None:
    clock = Clock()
    w = Waits(clock)
    w.enter()  # a call awaited at t=0 ...
    clock.now = 1.0
    w.enter()  # ... and, inside it or beside it, another from t=1 to t=2
    clock.now = 2.0
    w.leave()
    assert w.seconds() == 2.0  # under way: counts up to now
    clock.now = 3.0
    w.leave()
    clock.now = 10.0  # not waiting: nothing accrues
    assert w.seconds() == 3.0
    w.enter()
    clock.now = 10.5
    w.leave()
    assert w.seconds() == 3.5


@pytest.mark.parametrize("kind", KINDS)
async def test_awaited_collectives_are_counted(kind: str) -> None:
    async with group_world(kind, 2) as groups:
        before = WAITS.seconds()
        got = await on_all(groups, lambda g: g.all_reduce(np.ones(8)))
        assert all(np.array_equal(r, np.full(8, 2.0)) for r in got)
        middle = WAITS.seconds()
        assert middle > before
        works = [g.all_reduce(np.ones(8)).start() for g in groups]
        done = await on_all(groups, lambda g: works[g.rank].wait())
        assert all(np.array_equal(r, np.full(8, 2.0)) for r in done)
        assert WAITS.seconds() >= middle  # only while a wait was under way
