"""The node arena under real groups: used by groups on one node, pipelined in slot-sized
chunks, the oracle's results, one region per group that leaves nothing in /dev/shm,
TCP (with one warning) when the region cannot be made, and every failure waking every
waiter of the node with the root cause."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from shardwire.protocol import CollectiveMismatch, CollectiveTimeout, InvalidArgument, PeerFailed
from shardwire.worker.arena.board import Board
from shardwire.worker.arena.region import Geometry, Region
from shardwire.worker.backends.arena import EXPRESS_BYTES
from shardwire.worker.backends.gate import GateState
from shardwire.worker.collectives import Group, ReduceOp
from shardwire.worker.transport.shmfiles import run_prefix, segment_names
from tests.isolation import RUN_ID
from tests.worker.collectives.worlds import groups_over, on_all
from tests.worker.transport.fabric import tcp_world


def mapped(run_id: str = RUN_ID) -> list[str]:
    prefix = run_prefix(run_id)
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if prefix in line]


@pytest.fixture(autouse=True)
def _nothing_left():
    yield
    assert segment_names(RUN_ID) == []
    assert mapped() == []


def arena_groups(
    n: int, *, timeout: float = 20.0, **config
) -> contextlib.AbstractAsyncContextManager[list[Group]]:
    return groups_over(tcp_world(n, arena=True, timeout=timeout, **config), timeout)


def _inputs(n: int, count: int, dtype: str = "float64", salt: int = 0) -> list[np.ndarray]:
    return [
        np.random.default_rng(100 * r + salt).integers(-3, 4, count).astype(dtype) for r in range(n)
    ]


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_collectives_run_on_the_arena_and_match_numpy_across_chunks(n: int) -> None:
    # 16 KiB slots: 8 KiB halves, so 5000 float64 values take several chunks.
    async with arena_groups(n, arena_slot_bytes=16 << 10) as groups:
        for count in (0, 1, 7, 1000, 5003):
            xs = _inputs(n, count, salt=count)
            got = await on_all(groups, lambda g: g.all_reduce(xs[g.rank].copy()))
            for out in got:
                np.testing.assert_array_equal(out, sum(xs))
            mins = await on_all(groups, lambda g: g.all_reduce(xs[g.rank].copy(), ReduceOp.MIN))
            np.testing.assert_array_equal(mins[-1], np.minimum.reduce(xs))
            gathered = await on_all(groups, lambda g: g.all_gather(xs[g.rank]))
            for out in gathered:
                np.testing.assert_array_equal(out, np.concatenate(xs))
            root = count % n
            sent = await on_all(groups, lambda g: g.broadcast(xs[g.rank].copy(), root=root))
            for out in sent:
                np.testing.assert_array_equal(out, xs[root])
            await on_all(groups, lambda g: g.barrier())
        # uneven reduce_scatter and all_gather sizes, AVG divided by the group size
        sizes = [3000 + 7 * r for r in range(n)]
        xs = _inputs(n, sum(sizes), salt=9)
        parts = await on_all(
            groups, lambda g: g.reduce_scatter(xs[g.rank], ReduceOp.AVG, sizes=sizes)
        )
        edges = np.cumsum([0, *sizes])
        for r, part in enumerate(parts):
            np.testing.assert_allclose(part, (sum(xs) / n)[edges[r] : edges[r + 1]])
        ragged = [np.full(s, float(r)) for r, s in enumerate(sizes)]
        gathered = await on_all(groups, lambda g: g.all_gather(ragged[g.rank], sizes=sizes))
        np.testing.assert_array_equal(gathered[0], np.concatenate(ragged))
        engine = groups[0].backend.gate.arena.engine
        assert groups[0].backend.gate.state is GateState.OPEN
        assert engine.inline_runs + engine.thread_runs >= 5 * 5 + 2
        assert segment_names(RUN_ID) == []  # the name went once every rank had attached
        assert len(mapped()) == n  # one region, mapped once by each rank


@pytest.mark.parametrize("n", [2, 3, 5])
async def test_a_scan_runs_on_the_arena_and_matches_numpy_across_chunks(n: int) -> None:
    # 8 KiB halves: 5003 float64 values take five chunks; 40 bytes run express.
    async with arena_groups(n, arena_slot_bytes=16 << 10) as groups:
        for count in (0, 5, 5003):
            xs = _inputs(n, count, salt=count)
            calls = [g.scan(xs[g.rank].copy()) for g in groups]
            assert {str(c.decision) for c in calls} == {"arena/arena"}
            got = await asyncio.gather(*calls)
            for r, out in enumerate(got):
                np.testing.assert_array_equal(out, sum(xs[: r + 1]), err_msg=f"rank {r}")
            avg = await on_all(groups, lambda g: g.scan(xs[g.rank].copy(), ReduceOp.AVG))
            for r, out in enumerate(avg):
                np.testing.assert_allclose(out, sum(xs[: r + 1]) / (r + 1), err_msg=f"rank {r}")
            lows = await on_all(groups, lambda g: g.scan(xs[g.rank].copy(), ReduceOp.MIN))
            for r, out in enumerate(lows):
                np.testing.assert_array_equal(out, np.minimum.reduce(xs[: r + 1]))
        engine = groups[0].backend.gate.arena.engine
        assert engine.inline_runs + engine.thread_runs >= 9


async def test_every_rank_holds_the_same_bits_whatever_the_order_of_arrival() -> None:
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(200_001).astype(np.float32) for _ in range(4)]
    async with arena_groups(4, arena_slot_bytes=256 << 10) as groups:
        got = await on_all(groups, lambda g: g.all_reduce(xs[g.rank].copy()))
    assert all(out.tobytes() == got[0].tobytes() for out in got)
    np.testing.assert_allclose(got[0], ((xs[0] + xs[1]) + xs[2]) + xs[3], rtol=1e-6)


async def test_calls_run_in_call_order_whatever_order_they_are_awaited() -> None:
    async with arena_groups(2) as groups:

        async def run(g: Group) -> tuple[list[float], list[float]]:
            first = g.all_reduce(np.full(3, g.rank + 1.0))
            second = g.all_gather(np.array([g.rank * 10.0]))
            later = (await second).tolist()
            return (await first).tolist(), later

        assert await on_all(groups, run) == [([3.0] * 3, [0.0, 10.0])] * 2


async def test_groups_spanning_nodes_have_no_arena_of_their_own_node_groups_do() -> None:
    async with tcp_world(4, arena=True, per_node=2) as meshes:
        world = [Group(m) for m in meshes]
        halves = [g.new_group([0, 1] if g.rank < 2 else [2, 3], name="node") for g in world]
        out = await on_all(world, lambda g: g.all_reduce(np.full(5, 1.0 + g.rank)))
        assert all(o.tolist() == [10.0] * 5 for o in out)
        out = await on_all(halves, lambda g: g.all_reduce(np.full(5, 1.0 + g.transport.rank)))
        assert [o[0] for o in out] == [3.0, 3.0, 7.0, 7.0]
        assert world[0].backend.name == "tiered"  # over two nodes: no arena of its own
        assert all(
            h.backend.gate is not None and h.backend.gate.state is GateState.OPEN for h in halves
        )
        for g in world:
            await g.aclose()


async def test_a_region_that_cannot_be_made_is_one_warning_and_tcp_for_all(caplog) -> None:
    caplog.set_level(logging.INFO, "shardwire.worker")
    async with arena_groups(3, arena_slot_bytes=1 << 46) as groups:  # no /dev/shm has 192 TiB
        xs = _inputs(3, 1000)
        got = await on_all(groups, lambda g: g.all_reduce(xs[g.rank].copy()))
        np.testing.assert_array_equal(got[2], sum(xs))
        assert all(g.backend.gate.state is GateState.UNAVAILABLE for g in groups)
        got = await on_all(groups, lambda g: g.all_gather(xs[g.rank]))  # still on TCP
        np.testing.assert_array_equal(got[1], np.concatenate(xs))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "SHARDWIRE_ARENA_SLOT_BYTES" in text and "bytes of /dev/shm for 3 ranks" in text


async def test_a_failed_peer_wakes_a_sleeping_waiter_at_once() -> None:
    async with arena_groups(2, timeout=60) as groups:
        await on_all(groups, lambda g: g.barrier())  # opened
        waiting = groups[0].all_reduce(np.ones(4)).start()  # rank 1 never joins
        engine = groups[0].backend.gate.arena.engine
        for _ in range(3):  # the call's task runs, finds rank 1 absent, hands over
            await asyncio.sleep(0)
        assert engine.driver == "thread"  # whose spin is 50 us: then it sleeps on the futex
        loop = asyncio.get_running_loop()
        start = loop.time()
        # rank 1's transport learns that rank 7 failed: it poisons its groups' arenas
        groups[1].transport.abort(PeerFailed(rank=7, reason="killed"))
        with pytest.raises(PeerFailed, match="rank 7 failed: killed") as caught:
            await waiting.wait()
        assert caught.value.rank == 7
        assert loop.time() - start < 5  # woken, not timed out (the group allows 60 s)


async def test_a_silent_rank_is_named_by_the_timeout() -> None:
    async with arena_groups(3, timeout=1.0) as groups:
        await on_all(groups, lambda g: g.barrier())
        calls = [groups[r].all_reduce(np.ones(10)).start() for r in (0, 1)]  # rank 2 silent
        for call in calls:
            with pytest.raises(CollectiveTimeout, match=r"not heard from ranks \[2\]"):
                await call.wait()


async def test_different_calls_on_different_ranks_are_a_mismatch_everywhere() -> None:
    async with arena_groups(2) as groups:
        await on_all(groups, lambda g: g.barrier())
        a = groups[0].all_reduce(np.ones(10)).start()
        b = groups[1].all_gather(np.ones(10)).start()
        for work in (a, b):
            with pytest.raises(CollectiveMismatch):
                await work.wait()


def test_a_rank_that_never_made_the_call_is_absent(tmp_path) -> None:
    region, _ = Region.create("test", Geometry(3, 8192), tmp_path)
    try:
        boards = [Board(region, r) for r in range(3)]
        boards[0].enter(7)
        boards[1].enter(7)
        boards[2].enter(6)
        assert boards[0].absent(7) == [2]
        assert boards[2].absent(7) == []  # it does not name itself
        assert boards[1].absent(6) == []
        boards[2].enter(7)
        assert boards[0].absent(7) == []
    finally:
        region.unlink()
        region.close()


async def test_a_started_call_runs_on_the_arena_thread_while_the_loop_computes() -> None:
    async with arena_groups(2) as groups:
        await on_all(groups, lambda g: g.barrier())  # the arena is open
        engines = [g.backend.gate.arena.engine for g in groups]
        before = [e.thread_runs for e in engines]
        # larger than an express call: a started call that size overlaps the loop's compute
        count = EXPRESS_BYTES // 8 + 1000
        works = [g.all_gather(np.full(count, g.rank + 1.0)).start() for g in groups]
        deadline = time.monotonic() + 30
        while [e.thread_runs for e in engines] != [b + 1 for b in before]:  # the loop is busy
            assert time.monotonic() < deadline, "the started calls did not run meanwhile"
            time.sleep(0.005)  # noqa: ASYNC251 (compute that holds the loop)
        for work in works:
            out = await work.wait()
            np.testing.assert_array_equal(out, np.repeat([1.0, 2.0], count))


async def test_a_group_that_asks_for_links_stays_off_its_arena() -> None:
    async with arena_groups(2) as groups:
        links = [g.new_group([0, 1], name="by links", backend="links") for g in groups]
        calls = [g.all_reduce(np.full(5, 1.0 + g.rank)) for g in links]
        assert {str(c.decision) for c in calls} == {"links/doubling"}
        assert [o.tolist() for o in await asyncio.gather(*calls)] == [[3.0] * 5] * 2
        calls = [g.all_reduce(np.full(5, 1.0 + g.rank)) for g in groups]
        assert {str(c.decision) for c in calls} == {"arena/arena"}
        await asyncio.gather(*calls)
        with pytest.raises(InvalidArgument, match="backend 'tiered' needs group"):
            groups[0].new_group([0, 1], name="tiered", backend="tiered").barrier()
