"""Mismatches, timeouts, dead peers, poisoning, concurrency and handles."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shardwire.protocol import (
    CollectiveCancelled,
    CollectiveMismatch,
    CollectiveTimeout,
    InvalidArgument,
    InvalidType,
    PeerFailed,
)
from tests.waiting import until
from tests.worker.transport.fabric import connect_all

from .worlds import KINDS, group_world, on_all

pytestmark = pytest.mark.parametrize("kind", KINDS)


async def _errors(groups, fn) -> list[BaseException | object]:
    async with asyncio.timeout(30):
        return list(await asyncio.gather(*(fn(g) for g in groups), return_exceptions=True))


async def test_different_collectives_raise_mismatch_on_every_rank(kind: str) -> None:
    async with group_world(kind, 3, timeout=20) as groups:
        x = np.ones(1000, np.float32)

        def call(g):
            if g.rank == 1:
                return g.all_gather(x)
            return g.all_reduce(x.copy())

        start = time.monotonic()
        results = await _errors(groups, call)
        assert time.monotonic() - start < 5  # not the 20 s timeout
        for r, err in enumerate(results):
            assert isinstance(err, CollectiveMismatch), (r, err)
        text = " ".join(str(e) for e in results)
        assert "all_gather:float32" in text and "all_reduce:float32:1000:sum" in text
        # the group stays poisoned with the original error
        with pytest.raises(CollectiveMismatch):
            await groups[0].barrier()


async def test_same_collective_different_sizes_is_a_mismatch(kind: str) -> None:
    async with group_world(kind, 2, timeout=20) as groups:
        sizes = [1000, 300_000]  # also lands the two ranks on different algorithms
        results = await _errors(groups, lambda g: g.all_reduce(np.ones(sizes[g.rank], np.float32)))
        assert all(isinstance(e, CollectiveMismatch) for e in results), results
        assert "1000" in str(results[0]) and "300000" in str(results[0])


async def test_timeout_names_the_silent_rank(kind: str) -> None:
    async with group_world(kind, 3, timeout=20) as groups:
        start = time.monotonic()

        async def call(g):
            if g.rank == 2:
                return None  # never joins the collective
            return await g.all_reduce(np.ones(10), timeout=0.5)

        results = await _errors(groups, call)
        elapsed = time.monotonic() - start
        assert elapsed < 3
        for r in (0, 1):
            assert isinstance(results[r], CollectiveTimeout), results[r]
            assert f"all_reduce #1 timed out after 0.5 s on rank {r}" in str(results[r])
        # rank 0 waits on rank 2 directly; rank 1 (folded into rank 0) waits on rank 0
        assert "not heard from ranks [2]" in str(results[0])
        assert "not heard from ranks [0]" in str(results[1])


def _kill_last(groups, kind: str) -> None:
    """The last rank dies: its hub entry goes, or every connection it has is cut."""
    victim = groups[-1].transport
    if kind == "memory":
        victim.hub.kill(victim.rank, "killed by test")
        return
    for conn in [victim.connection(p) for p in victim.peers()]:
        conn.transport.abort()


async def test_dead_peer_fails_every_survivor(kind: str) -> None:
    async with group_world(kind, 4, timeout=30) as groups:
        await connect_all([g.transport for g in groups])  # its death closes connections
        big = [np.ones(2_000_000, np.float32) for _ in range(4)]
        tasks = [asyncio.ensure_future(g.all_reduce(big[g.rank])) for g in groups if g.rank != 3]
        await asyncio.sleep(0)
        start = time.monotonic()
        _kill_last(groups, kind)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - start < 2
        for err in results:
            assert isinstance(err, PeerFailed) and err.rank == 3, err
        with pytest.raises(PeerFailed):
            await groups[0].all_reduce(np.ones(3))


async def test_a_peer_dead_between_calls_is_the_group_s_failure_before_its_next_call(
    kind: str,
) -> None:
    """A peer dies while no call is under way: each survivor's group already names that
    failure (what torch's bridge asks when DDP's reducer hides the error), and its next
    call raises the same error."""
    async with group_world(kind, 4, timeout=30) as groups:
        await connect_all([g.transport for g in groups])
        _kill_last(groups, kind)
        survivors = groups[:3]
        await until(lambda: all(g.failed_now() is not None for g in survivors), "the death known")
        for g in survivors:
            failure = g.failed_now()
            assert isinstance(failure, PeerFailed) and failure.rank == 3, failure
            with pytest.raises(PeerFailed) as raised:
                await g.all_reduce(np.ones(3))
            assert raised.value is failure


async def test_two_groups_run_concurrently_without_cross_talk(kind: str) -> None:
    async with group_world(kind, 4, timeout=20) as groups:
        pairs = [g.new_group([0, 1] if g.rank < 2 else [2, 3]) for g in groups]
        evens = [g.new_group([0, 2], name="even") if g.rank % 2 == 0 else None for g in groups]

        async def run(g):
            sub = pairs[g.rank]
            x = np.full(50_000, g.rank + 1.0)
            y = np.full(7, 10.0 * (g.rank + 1))
            jobs = [sub.all_reduce(x), g.all_reduce(y)]
            if evens[g.rank] is not None:
                jobs.append(evens[g.rank].all_gather(np.array([g.rank])))
            return await asyncio.gather(*jobs)

        out = await on_all(groups, run)
        for r, got in enumerate(out):
            assert got[0][0] == (3.0 if r < 2 else 7.0)
            assert got[1][0] == 100.0
            if r % 2 == 0:
                assert got[2].tolist() == [0, 2]


async def test_async_handles_wait_and_done(kind: str) -> None:
    async with group_world(kind, 2, timeout=20) as groups:

        async def run(g):
            first = g.all_reduce(np.ones(4)).start()
            second = g.all_gather(np.array([g.rank])).start()
            got = (await second.wait()).tolist(), (await first.wait()).tolist()
            assert first.done() and second.done()
            return got

        assert await on_all(groups, run) == [([0, 1], [2.0] * 4)] * 2


async def test_cancelled_collective_poisons_the_group_everywhere(kind: str) -> None:
    async with group_world(kind, 2, timeout=20) as groups:
        work = groups[0].all_reduce(np.ones(10)).start()  # rank 1 never joins
        await asyncio.sleep(0)
        work.cancel()
        with pytest.raises(asyncio.CancelledError):
            await work.wait()
        cancelled = "all_reduce #1 was cancelled on rank 0"
        with pytest.raises(CollectiveCancelled, match=cancelled) as own:
            await groups[0].barrier()
        with pytest.raises(CollectiveCancelled) as relayed:
            await groups[1].all_reduce(np.ones(10))
        # the rank it began on, for the coordinator: rank 1 blames rank 0, not itself
        assert (own.value.origin, relayed.value.origin) == (-1, 0)


async def test_group_close_cancels_forgotten_handles(kind: str) -> None:
    async with group_world(kind, 2, timeout=20) as groups:
        work = groups[0].all_reduce(np.ones(10)).start()  # never awaited, peer silent
        before = asyncio.all_tasks()
        await groups[0].aclose()
        after = asyncio.all_tasks()
        assert work.done()
        # the call's task (and, on an arena, the task opening it) ended; nothing new runs
        assert len(after) < len(before) and after <= before


async def test_closing_groups_with_started_two_tier_calls_ends_them_before_their_phases(
    kind: str,
) -> None:
    # a started call of a tiered group runs its phases on the node and lane subgroups:
    # the group ends its calls before it closes them (and unmaps the node's region)
    async with group_world(kind, 4, timeout=20) as groups:
        works = [g.all_reduce(np.ones(5000)).start() for g in groups]
        await asyncio.sleep(0)  # the calls begin their first phase
        for g in groups:
            await g.aclose()
        assert all(w.done() for w in works)


async def test_argument_errors_are_clear(kind: str) -> None:
    """Raised at the call, as ShardwireErrors that are also ValueError / TypeError."""
    async with group_world(kind, 2) as groups:
        g = groups[0]
        with pytest.raises(InvalidType, match="AVG needs a floating dtype"):
            g.all_reduce(np.ones(3, np.int32), "avg")
        with pytest.raises(InvalidArgument, match="not divisible by 2 ranks"):
            g.reduce_scatter(np.ones(3))
        with pytest.raises(InvalidArgument, match="root 5 is not a rank"):
            g.broadcast(np.ones(3), root=5)
        with pytest.raises(InvalidArgument, match="C-contiguous"):
            g.all_reduce(np.ones((4, 4))[:, ::2])
