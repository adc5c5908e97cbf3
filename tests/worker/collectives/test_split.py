"""A traced collective's time, split into waiting for peers, reducing and moving bytes,
over every path: the rank that waited for a late one shows the wait, a reduction shows
as reducing, the three add up to the call, and nothing is split when nothing is traced."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.worker.observe import trace
from shardwire.worker.observe.flight import split_ms
from shardwire.worker.observe.split import Split

from .worlds import group_world, on_all

LATE_S = 0.15


def test_overlapping_waits_count_once_and_the_parts_add_up() -> None:
    split = Split()
    split.waited(1.0, 3.0)
    split.waited(2.0, 4.0)  # overlaps the first: one more second
    split.waited(10.0, 10.5)
    split.waited(5.0, 5.0)  # empty
    split.wait_s = 0.25  # the arena's waits, measured as one figure
    assert split.waiting() == pytest.approx(3.75)
    split.reduce_s = 1.0
    assert split_ms(split, 6.0) == {"wait_ms": 3750.0, "reduce_ms": 1000.0, "move_ms": 1250.0}
    # measurements never add up to more than the call took
    assert split_ms(split, 4.0) == {"wait_ms": 3750.0, "reduce_ms": 250.0, "move_ms": 0.0}


def _collectives(tracer: trace.Tracer, op: str) -> list[dict]:
    """The ``op`` slices with their durations (each "b" event is followed by its "e")."""
    events = tracer.events()
    return [
        {**b["args"], "dur_ms": (e["ts"] - b["ts"]) / 1e3}
        for b, e in zip(events, events[1:], strict=False)
        if b.get("ph") == "b" and b["name"] == op and e.get("ph") == "e"
    ]


@pytest.mark.parametrize("kind", ["tcp", "shm", "pairs"])
@pytest.mark.parametrize("size", [16, 1 << 18])  # an express-sized call and a 2 MiB one
async def test_the_rank_that_waited_shows_the_wait(kind: str, size: int, tmp_path) -> None:
    tracer = trace.Tracer(0, tmp_path)
    trace.install(tracer)  # every in-process rank records into this one
    try:
        async with group_world(kind, 2) as groups:
            await on_all(groups, lambda g: g.barrier())  # connections and arena are up

            async def late(g) -> None:
                x = np.full(size, g.rank + 1.0)
                if g.rank == 1:
                    await asyncio.sleep(LATE_S)
                await g.all_reduce(x)
                assert np.all(x == 3.0)

            await on_all(groups, late)
    finally:
        trace.install(None)
    calls = _collectives(tracer, "all_reduce")
    assert len(calls) == 2, calls
    for call in calls:
        parts = call["wait_ms"] + call["reduce_ms"] + call["move_ms"]
        assert parts == pytest.approx(call["dur_ms"], abs=0.01), call
        assert min(call["wait_ms"], call["reduce_ms"], call["move_ms"]) >= 0
    waited, prompt = sorted(calls, key=lambda c: -c["wait_ms"])
    assert waited["wait_ms"] >= 0.6 * LATE_S * 1e3, calls  # rank 0 waited for rank 1
    assert prompt["wait_ms"] < waited["wait_ms"] / 2, calls
    if size > 1 << 16:  # large enough that a reduction takes measurable time
        assert max(c["reduce_ms"] for c in calls) > 0, calls
    algorithms = {c["algorithm"] for c in calls}
    assert algorithms == ({"arena"} if kind == "shm" else {"doubling" if size == 16 else "ring"})
    # the path its bytes took: the node arena, or the peer connections (per-pair shared
    # memory for large payloads between ranks of a node)
    paths = {c["path"] for c in calls}
    assert paths == {
        "arena" if kind == "shm" else "shm" if kind == "pairs" and size > 16 else "tcp"
    }


async def test_a_call_over_nodes_is_split_in_its_subgroups_calls(tmp_path) -> None:
    tracer = trace.Tracer(0, tmp_path)
    trace.install(tracer)
    try:
        async with group_world("mixed", 4) as groups:  # two nodes of two ranks
            await on_all(groups, lambda g: g.all_reduce(np.ones(1 << 16)))
    finally:
        trace.install(None)
    calls = _collectives(tracer, "all_reduce")
    outer = [c for c in calls if c["size"] == 4]
    inner = [c for c in calls if c["size"] == 2]
    assert len(outer) == 4 and all(c["algorithm"] == "hierarchical" for c in outer)
    assert all("wait_ms" not in c for c in outer)  # its time is in the subgroups' calls
    assert inner and all("wait_ms" in c for c in inner)


async def test_untraced_calls_are_not_split() -> None:
    trace.install(None)
    async with group_world("tcp", 2) as groups:
        results = await on_all(groups, lambda g: g.all_reduce(np.ones(1 << 16)))
    assert all(np.all(r == 2.0) for r in results)
    # nothing recorded anywhere: the flight recorder's entries carry no split
    assert all(e.split is None for g in groups for e in g.recorder._ring)
