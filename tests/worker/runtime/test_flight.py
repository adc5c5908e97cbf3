"""The flight recorder: entries, outcomes, capacity and live pending ranks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import CollectiveTimeout
from shardwire.worker.observe.flight import FlightRecorder
from tests.worker.collectives.worlds import group_world


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_entries_keep_their_outcome_and_age() -> None:
    clock = Clock()
    fr = FlightRecorder(capacity=3, clock=clock)
    a = fr.begin(group=0, ranks=[0, 1], op="all_reduce", seq=1, nbytes=8, pending=lambda: [1])
    clock.now += 2
    fr.end(a, "ok")
    b = fr.begin(group=7, ranks=[0, 1], op="broadcast", seq=1, nbytes=4, pending=lambda: [1])
    clock.now += 1
    first, second = fr.snapshot(live=True)
    assert (first.op, first.seq, first.outcome, first.duration_s, first.age_s) == (
        "all_reduce",
        1,
        "ok",
        2.0,
        3.0,
    )
    assert (second.group, second.outcome, second.duration_s, second.pending) == (
        7,
        "running",
        None,
        [1],
    )
    assert fr.snapshot(live=False)[1].pending == []  # the call is not asked off its loop
    fr.end(b, "timeout", silent=[1])
    for seq in range(2, 5):
        fr.begin(group=0, ranks=[0, 1], op="barrier", seq=seq, nbytes=0)
    assert [r.seq for r in fr.snapshot(live=True)] == [2, 3, 4]  # capacity 3


def test_large_groups_are_sent_as_runs_or_by_size() -> None:
    fr = FlightRecorder()
    fr.begin(group=0, ranks=range(500), op="all_reduce", seq=1, nbytes=0)
    fr.begin(group=5, ranks=range(3, 1024, 4), op="all_reduce", seq=1, nbytes=0)  # a lane
    irregular = [r * r for r in range(200)]
    fr.begin(group=6, ranks=irregular, op="all_reduce", seq=1, nbytes=0)
    world, lane, odd = fr.snapshot(live=False)
    assert (world.size, world.ranks, world.runs) == (500, [], [(0, 500, 1)])
    assert (lane.size, lane.ranks, lane.runs) == (256, [], [(3, 1024, 4)])
    assert (odd.size, odd.ranks, odd.runs) == (200, [], [])


async def test_collectives_record_themselves_including_a_timeout() -> None:
    async with group_world("memory", 2) as groups:
        await asyncio.gather(*(g.all_reduce(np.ones(4)) for g in groups))
        with pytest.raises(CollectiveTimeout):
            await groups[0].all_reduce(np.ones(4), timeout=0.2)  # rank 1 never comes
        records = groups[0].recorder.snapshot(live=True)
    assert [(r.op, r.seq, r.nbytes, r.outcome) for r in records] == [
        ("all_reduce", 1, 32, "ok"),
        ("all_reduce", 2, 32, "timeout"),
    ]
    assert records[1].pending == [1] and records[0].ranks == [0, 1]
