"""Call deadlines: one timer per group, armed at the earliest deadline that can fire."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from shardwire.protocol import CollectiveCancelled, CollectiveTimeout
from shardwire.worker.collectives.deadlines import Deadlines

from .worlds import group_world, on_all


async def _expires(deadlines: Deadlines, seq: int, limit: float) -> bool:
    """Run a call that outlives ``limit`` in a task of its own; whether it was told it
    expired."""

    async def call() -> bool:
        deadlines.watch(seq, limit)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return deadlines.release(seq)
        return False

    async with asyncio.timeout(10):
        return await asyncio.create_task(call())


async def test_a_call_past_its_deadline_is_cancelled_and_told_it_expired() -> None:
    assert await _expires(Deadlines(), 1, 0.05) is True


async def test_a_call_ending_in_time_leaves_nothing_behind() -> None:
    deadlines = Deadlines()
    for seq in range(1, 200):
        deadlines.watch(seq, 30.0)
        await asyncio.sleep(0)
        assert deadlines.release(seq) is False
    assert deadlines.watched() == []
    assert deadlines.armed_at < math.inf  # armed once, for the first call's deadline
    deadlines.close()


async def test_a_shorter_deadline_rearms_the_timer_earlier() -> None:
    deadlines = Deadlines()
    deadlines.watch(1, 300.0)  # a long call still running
    start = time.monotonic()
    assert await _expires(deadlines, 2, 0.05) is True
    assert time.monotonic() - start < 5
    assert deadlines.watched() == [1] and deadlines.release(1) is False
    deadlines.close()


async def test_an_infinite_limit_arms_nothing() -> None:
    deadlines = Deadlines()
    deadlines.watch(1, math.inf)
    assert deadlines.armed_at == math.inf and deadlines.release(1) is False


async def test_a_cancellation_from_elsewhere_is_not_a_timeout() -> None:
    deadlines = Deadlines()
    released: list[bool] = []

    async def call() -> None:
        deadlines.watch(1, 30.0)
        try:
            await asyncio.sleep(30)
        finally:
            released.append(deadlines.release(1))

    task = asyncio.create_task(call())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == [False]
    deadlines.close()


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_group_calls_time_out_at_their_own_limit_after_long_ones(kind: str) -> None:
    async with group_world(kind, 2, timeout=60) as groups:
        await on_all(groups, lambda g: g.all_reduce(np.ones(8)))  # arms the 60 s timer
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match="timed out after 0.3 s on rank 0"):
            await groups[0].all_reduce(np.ones(8), timeout=0.3)  # rank 1 never joins
        assert time.monotonic() - start < 10  # not the group's 60 s


@pytest.mark.parametrize("kind", ["memory", "tcp"])
async def test_a_cancelled_call_is_cancelled_not_timed_out(kind: str) -> None:
    async with group_world(kind, 2, timeout=60) as groups:
        task = asyncio.ensure_future(groups[0].all_reduce(np.ones(8)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(CollectiveCancelled):
            await groups[0].barrier()
