"""Group lifetimes: unique ids per transport, subgroups owned and closed by their parent,
the scratch pool reused across calls, and closing that never eats the closer's own
cancellation."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shardwire.protocol import CollectiveMismatch, InvalidArgument, InvalidState, TransportClosed
from shardwire.worker.collectives import Group
from shardwire.worker.transport import TransportTimeout

from .worlds import KINDS, group_world, on_all

pytestmark = pytest.mark.parametrize("kind", KINDS)


def _messages(kind: str) -> str:
    """The same world with its groups moving data by messages: with the arena on, groups
    on one node run their collectives on it, and groups over nodes in node phases,
    without scratch or algorithm choice."""
    return "pairs" if kind in ("shm", "mixed") else kind


async def test_scratch_buffers_are_reused_across_calls(kind: str) -> None:
    async with group_world(_messages(kind), 3) as groups:
        x = np.ones(300_000)
        await on_all(groups, lambda g: g.all_reduce(x))
        first = groups[0].pool.misses
        assert first > 0 and groups[0].pool.hits == 0
        for _ in range(3):
            await on_all(groups, lambda g: g.all_reduce(x))
        assert groups[0].pool.misses == first  # no allocation after the first call
        assert groups[0].pool.hits >= 3


async def test_asking_twice_for_a_subgroup_returns_the_same_group(kind: str) -> None:
    async with group_world(kind, 4) as groups:
        pairs = [g.new_group([0, 1] if g.rank < 2 else [2, 3], name="pair") for g in groups]
        again = [g.new_group([0, 1] if g.rank < 2 else [2, 3], name="pair") for g in groups]
        assert all(a is b for a, b in zip(pairs, again, strict=True))
        await on_all(pairs, lambda g: g.all_reduce(np.ones(4)))
        out = await on_all(again, lambda g: g.all_reduce(np.ones(4)))  # one sequence
        assert all(o.tolist() == [2.0] * 4 for o in out)


async def test_a_second_group_with_a_live_id_is_refused(kind: str) -> None:
    async with group_world(kind, 2) as groups:
        with pytest.raises(InvalidArgument, match="group id 0 is already used on rank 0"):
            Group(groups[0].transport)


async def test_closing_a_group_closes_its_subgroups(kind: str) -> None:
    async with group_world(kind, 4) as groups:
        halves = [g.new_group([0, 1] if g.rank < 2 else [2, 3]) for g in groups]
        await on_all(halves, lambda g: g.barrier())
        ids = {h.group_id for h in halves}
        await groups[0].aclose()
        with pytest.raises(TransportClosed, match="is closed"):
            await halves[0].barrier()
        assert not ids & set(groups[0].transport.groups)  # the ids are free again


async def test_closing_does_not_swallow_the_closers_own_cancellation(kind: str) -> None:
    async with group_world(kind, 2, timeout=20) as groups:
        hung = groups[0].all_reduce(np.ones(10)).start()  # the peer never joins
        closer = asyncio.ensure_future(groups[0].aclose())
        await asyncio.sleep(0)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        await groups[0].aclose()  # a second close finishes what the first began
        assert hung.done()


async def test_a_call_is_awaited_or_started_once(kind: str) -> None:
    async with group_world(kind, 2) as groups:
        calls = [g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups]
        works = [c.start() for c in calls]
        results = await asyncio.gather(*(w.wait() for w in works))
        assert [r.tolist() for r in results] == [[3.0] * 3] * 2
        with pytest.raises(InvalidState, match="already awaited or started"):
            await calls[0]


async def test_a_group_runs_the_algorithm_it_pins(kind: str) -> None:
    async with group_world(_messages(kind), 3) as groups:
        pinned = [
            g.new_group(range(3), name="pinned", algorithms={"all_reduce": "ring"}) for g in groups
        ]
        calls = [g.all_reduce(np.full(10, g.rank + 1.0)) for g in pinned]
        assert {str(c.decision) for c in calls} == {"links/ring"}  # the thresholds say doubling
        out = await asyncio.gather(*calls)
        plain = [g.all_reduce(np.full(10, g.rank + 1.0)) for g in groups]
        assert {str(c.decision) for c in plain} == {"links/doubling"}
        await asyncio.gather(*plain)
    assert all(o.tolist() == [6.0] * 10 for o in out)


async def test_members_that_pin_differently_fail_as_a_mismatch(kind: str) -> None:
    async with group_world(_messages(kind), 2) as groups:
        pins = [{"all_reduce": "ring"}, {}]
        pinned = [
            g.new_group(range(2), name="p", timeout=30.0, algorithms=pins[g.rank]) for g in groups
        ]
        results = await asyncio.gather(
            *(g.all_reduce(np.ones(4)) for g in pinned), return_exceptions=True
        )
    assert all(isinstance(r, CollectiveMismatch) for r in results), results


async def test_point_to_point_calls_are_pending_calls_with_their_own_timeout(kind: str) -> None:
    async with group_world(_messages(kind), 3, timeout=30.0) as groups:
        a, b, c = groups
        sending = a.send(np.arange(4.0), 2, tag=7).start()  # started like a collective
        receiving = c.recv(0, tag=7)
        assert receiving.decision is None  # no backend decides a point-to-point message
        assert (await receiving).tolist() == [0.0, 1.0, 2.0, 3.0]
        await sending.wait()
        await b.send(np.ones(2), 2, tag=8)
        src, got = await c.recv_any(tag=8, timeout=5.0)
        assert (src, got.tolist()) == (1, [1.0, 1.0])
        started = time.monotonic()
        with pytest.raises(TransportTimeout, match="timed out after 0.2 s"):
            await c.recv(1, tag=9, timeout=0.2)  # the call's own limit, not the group's 30 s
        with pytest.raises(TransportTimeout):
            await c.recv_any(tag=9, timeout=0.2)
        assert time.monotonic() - started < 10.0
        with pytest.raises(InvalidArgument, match="dst 3 is not a rank of this group of 3"):
            a.send(np.ones(1), 3)
        with pytest.raises(InvalidArgument, match="tag must be in"):
            a.recv(1, tag=-1)
