"""Express calls: a small arena call runs when it is made if the arena is idle, ends
before it is awaited when its peers are there, and otherwise hands over to the engine
without changing its result, its order or its errors."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import numpy as np
import pytest

from shardwire.protocol import CollectiveMismatch, CollectiveTimeout, InvalidState
from shardwire.worker.arena.atomics import Words
from shardwire.worker.arena.board import DONE, PID, READY, SLEEPERS, Board
from shardwire.worker.arena.engine import Engine
from shardwire.worker.arena.programs import Need
from shardwire.worker.arena.region import Geometry, Region
from shardwire.worker.backends.arena import EXPRESS_BYTES
from shardwire.worker.collectives import Group
from shardwire.worker.transport import mesh as mesh_module
from shardwire.worker.transport.arena_settings import CROWDED_NAP
from tests.waiting import until
from tests.worker.arena.test_arena import arena_groups
from tests.worker.collectives.worlds import on_all


async def _opened(groups: list[Group]) -> None:
    """The groups' arenas are open and every engine is idle again: a thread that ran the
    last call lets go of the queue a moment after that call's waiter is woken."""
    await on_all(groups, lambda g: g.barrier())
    engines = [g.backend.gate.arena.engine for g in groups]
    await until(lambda: all(e.driver is None for e in engines), "the arena engines idle")


async def test_a_small_call_whose_peers_are_there_ends_before_it_is_awaited() -> None:
    async with arena_groups(2) as groups:
        await _opened(groups)
        engines = [g.backend.gate.arena.engine for g in groups]
        xs = [np.full(256, g.rank + 1.0) for g in groups]
        # rank 0 is first: its peer has not made the call, so the engine's thread takes it
        first = groups[0].all_reduce(xs[0])
        # rank 1 finds rank 0's part published and reduces it at once, in place
        before = engines[1].inline_runs
        second = groups[1].all_reduce(xs[1])
        assert xs[1].tolist() == [3.0] * 256, "the call did not run when it was made"
        assert engines[1].inline_runs == before + 1
        assert (await second) is xs[1]
        assert (await first).tolist() == [3.0] * 256
        for g in groups:  # the flight recorder has the call, ended
            last = g.recorder.snapshot(live=True)[-1]
            assert (last.op, last.outcome, last.seq) == ("all_reduce", "ok", 2)


async def test_an_ended_call_can_still_be_started_and_awaited_once() -> None:
    async with arena_groups(2) as groups:
        await _opened(groups)
        first = groups[0].broadcast(np.arange(4.0), root=0)
        second = groups[1].broadcast(np.zeros(4), root=0)
        work = second.start()
        assert work.done()
        assert (await work.wait()).tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(InvalidState, match="already awaited or started"):
            await second
        await first


async def test_express_and_queued_calls_keep_call_order_whatever_the_await_order() -> None:
    big = EXPRESS_BYTES // 8 + 100  # queued: it runs when awaited or driven
    async with arena_groups(3) as groups:
        await _opened(groups)

        async def run(g: Group) -> tuple[float, list[float], float]:
            large = g.all_reduce(np.full(big, g.rank + 1.0))
            small = g.all_gather(np.array([g.rank * 10.0]))  # the engine is busy: queued
            tiny = g.all_reduce(np.array([1.0]))
            last = (await tiny)[0]
            gathered = (await small).tolist()
            return (await large)[big - 1], gathered, last

        assert await on_all(groups, run) == [(6.0, [0.0, 10.0, 20.0], 3.0)] * 3


async def test_a_different_call_found_at_once_is_a_mismatch_everywhere() -> None:
    async with arena_groups(2) as groups:
        await _opened(groups)
        first = groups[0].all_reduce(np.ones(8))
        second = groups[1].all_reduce(np.ones(9))  # runs at once and reads rank 0's half
        for call in (second, first):
            with pytest.raises(CollectiveMismatch):
                await asyncio.wait_for(call, 60)


@pytest.mark.parametrize("cpus", [1, 64])
async def test_only_a_crowded_node_lets_express_calls_nap(cpus: int, monkeypatch) -> None:
    monkeypatch.setattr(mesh_module, "usable_cpus", lambda: cpus)
    async with arena_groups(2) as groups:
        await _opened(groups)
        for g in groups:
            settings = g.transport.topology.arena
            assert settings is not None and settings.nap == (CROWDED_NAP if cpus == 1 else 0.0)
            assert g.backend.gate.arena.engine.nap == settings.nap


async def test_every_arena_call_carries_its_group_s_call_number(monkeypatch) -> None:
    """A crowded wait polls for peers between calls by the call's number: the job an
    express call runs as, and the job a queued (large) call runs as, hold the group's
    sequence number of that call."""
    seqs: dict[str, list[int]] = {"express": [], "submit": []}
    real_express, real_submit = Engine.express, Engine.submit

    def express(self, program, deadline, split=None, seq=0):
        seqs["express"].append(seq)
        return real_express(self, program, deadline, split, seq)

    def submit(self, program, deadline, split=None, seq=0):
        seqs["submit"].append(seq)
        return real_submit(self, program, deadline, split, seq)

    monkeypatch.setattr(Engine, "express", express)
    monkeypatch.setattr(Engine, "submit", submit)
    async with arena_groups(2) as groups:
        await _opened(groups)
        for size in (16, EXPRESS_BYTES // 8 + 1000):
            for found in seqs.values():
                found.clear()
            await on_all(groups, lambda g, size=size: g.all_reduce(np.ones(size)))
            kind = "express" if size == 16 else "submit"
            assert seqs[kind] and all(seq == groups[0]._seq for seq in seqs[kind]), seqs


@pytest.mark.parametrize(("nap", "beside"), [(0.0, False), (30.0, False), (30.0, True)])
async def test_an_express_wait_naps_on_the_loop_only_if_allowed(
    tmp_path, nap: float, beside: bool
) -> None:
    """Rank 1 publishes 50 ms late from another thread: with a nap the call ends on the
    loop (woken through the futex); without one, or when rank 1 runs in this process
    (whose loop the nap would hold up), the engine's thread takes it over."""
    region, _ = Region.create("test", Geometry(2, 8192), tmp_path)
    boards = [Board(region, 0), Board(region, 1)]
    if not beside:  # rank 1's row names another process, as on a real node
        boards[1].words.exchange32(boards[1].mine + PID, os.getpid() + 1)
    engine = Engine(boards[0], spin=0.0, yield_cpu=False, nap=nap, name="express-test")
    late = threading.Timer(0.05, boards[1].publish, (READY, 1))

    def program():
        boards[0].publish(READY, 1)
        yield Need(READY, [1], 1)
        boards[0].publish(DONE, 1)

    try:
        late.start()
        started = time.monotonic()
        assert engine.claim()
        job = engine.express(program(), time.monotonic() + 60, seq=7)
        if nap and not beside:
            assert job.finished and job.error is None and engine.inline_runs == 1
            assert time.monotonic() - started < nap / 2  # woken, not timed out
        else:
            assert not job.finished and engine.driver == "thread"
            await asyncio.wait_for(engine.run(job), 60)
            assert engine.thread_runs == 1
    finally:  # nothing may touch the region once it is unmapped
        late.join()
        assert engine.close()
        region.unlink()
        region.close()


async def test_a_large_call_awaited_when_its_peers_are_there_ends_where_it_is_awaited() -> None:
    count = EXPRESS_BYTES // 8 + 1000  # too large to run when made: it runs when awaited
    async with arena_groups(2) as groups:
        await _opened(groups)
        engines = [g.backend.gate.arena.engine for g in groups]
        board = groups[1].backend.gate.arena.board
        ready = board.value(0, READY)
        first = groups[0].all_gather(np.full(count, 1.0)).start()  # the thread runs it
        deadline = time.monotonic() + 30
        while board.value(0, READY) == ready:  # until rank 0 has published its part
            assert time.monotonic() < deadline, "rank 0's started call did not publish"
            await asyncio.sleep(0.001)
        second = groups[1].all_gather(np.full(count, 2.0))
        before = engines[1].inline_runs
        out = await second  # finds rank 0's part there: it runs on the loop, not the thread
        assert engines[1].inline_runs == before + 1
        np.testing.assert_array_equal(out, np.repeat([1.0, 2.0], count))
        np.testing.assert_array_equal(await first.wait(), out)
        last = groups[1].recorder.snapshot(live=True)[-1]
        assert (last.op, last.outcome) == ("all_gather", "ok")


async def test_a_large_call_awaited_without_its_peers_waits_and_names_them() -> None:
    count = EXPRESS_BYTES // 8 + 1000
    async with arena_groups(3, timeout=1.0) as groups:
        await _opened(groups)
        calls = [groups[r].all_reduce(np.ones(count)) for r in (0, 1)]  # rank 2 is silent
        results = await asyncio.gather(*calls, return_exceptions=True)
        for error in results:
            assert isinstance(error, CollectiveTimeout), error
            assert "not heard from ranks [2]" in str(error)


def _futex_sleeps(monkeypatch) -> list[int]:
    """A list that gets an item for every futex sleep entered from now on."""
    slept: list[int] = []
    real_sleep = Words.sleep

    def sleep(self, *args, **kwargs):
        slept.append(1)
        return real_sleep(self, *args, **kwargs)

    monkeypatch.setattr(Words, "sleep", sleep)
    return slept


def _two_boards(tmp_path) -> tuple[Region, list[Board]]:
    """Two ranks' boards over one region, rank 1's row naming another process."""
    region, _ = Region.create("test", Geometry(2, 8192), tmp_path)
    boards = [Board(region, 0), Board(region, 1)]
    boards[1].words.exchange32(boards[1].mine + PID, os.getpid() + 1)
    return region, boards


@pytest.mark.parametrize(
    ("entered", "publishes", "met"), [(4, True, True), (4, False, False), (3, True, False)]
)
def test_a_crowded_wait_polls_only_for_ranks_between_calls(
    tmp_path, entered: int, publishes: bool, met: bool
) -> None:
    """Waiting in call 5: rank 1 made call 4 (between calls) and publishes 20 ms later,
    so the poll meets it without a sleep (its sleepers word stays clear); rank 1 that
    never publishes is given up at ``until``; rank 1 still before call 4 is not polled
    for at all, however long ``until`` allows."""
    region, boards = _two_boards(tmp_path)
    boards[1].enter(entered)
    late = threading.Timer(0.02, boards[1].publish, (READY, 1)) if publishes else None
    try:
        if late is not None:
            late.start()
        started = time.monotonic()
        patience = 30.0 if publishes else 0.1
        assert boards[0].spin_inside(READY, [1], 1, 5, started + patience) is met
        took = time.monotonic() - started
        if entered < 4:
            assert took < 0.015  # before rank 1's publish: not polled
        elif not publishes:
            assert took >= 0.1
        assert boards[1].words.load32(boards[1].mine + SLEEPERS) == 0
    finally:
        if late is not None:
            late.join()
        region.unlink()
        region.close()


@pytest.mark.parametrize("path", ["express", "queued"])
async def test_a_crowded_call_on_the_loop_meets_a_peer_between_calls_without_sleeping(
    tmp_path, monkeypatch, path: str
) -> None:
    """On a crowded node (more ranks than CPUs) a call's wait on the loop, an express
    call's or a queued (large) call's driven when awaited, polls for a peer that made
    the previous call rather than sleeping on the futex or handing the call to the
    engine's thread (which would sleep there): it ends on the loop, no sleep entered."""
    region, boards = _two_boards(tmp_path)
    boards[1].enter(6)
    slept = _futex_sleeps(monkeypatch)
    nap = 30.0 if path == "express" else 0.0  # an express call may nap on the loop
    engine = Engine(boards[0], spin=0.0, yield_cpu=True, nap=nap, inside=30.0, name="crowded-test")
    late = threading.Timer(0.02, boards[1].publish, (READY, 1))

    def program():
        boards[0].publish(READY, 1)
        yield Need(READY, [1], 1)

    try:
        deadline = time.monotonic() + 60
        if path == "express":
            late.start()
            assert engine.claim()
            job = engine.express(program(), deadline, seq=7)
            assert job.finished
        else:
            job = engine.submit(program(), deadline, seq=7)
            late.start()
            await asyncio.wait_for(engine.run(job), 60)
        assert job.error is None and (engine.inline_runs, engine.thread_runs) == (1, 0)
        assert slept == []
    finally:
        late.join()
        assert engine.close()
        region.unlink()
        region.close()
