"""Busy polling of waiting receives: the default rule, the poller, and the option."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import Tag
from shardwire.worker import init
from shardwire.worker.runtime.worker_config import WorkerConfig
from shardwire.worker.transport.poll import (
    POLL_MAX_BYTES,
    BusyPoll,
    default_budget,
    usable_cpus,
)
from tests.worker.cluster import coordinator, worker_config
from tests.worker.transport.fabric import tcp_world


def test_polling_by_default_only_when_every_rank_has_a_cpu() -> None:
    assert default_budget(2, 2, None) == pytest.approx(100e-6)
    assert default_budget(1, 8, None) == pytest.approx(100e-6)
    assert default_budget(4, 2, None) == 0.0
    assert default_budget(4, 2, 250) == pytest.approx(250e-6)  # a setting wins
    assert default_budget(2, 8, 0) == 0.0


async def test_a_waiting_future_keeps_the_loop_polling_until_it_is_done() -> None:
    poll = BusyPoll(5.0)
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    poll.hold(future)
    loop.call_later(0.02, future.set_result, None)
    async with asyncio.timeout(10):
        await future
    polled = poll.polls
    assert polled > 10  # the loop turned over and over instead of sleeping
    await asyncio.sleep(0.02)
    assert poll.polls <= polled + 1  # and stopped with the message


async def test_polling_stops_after_its_budget() -> None:
    poll = BusyPoll(0.01)
    future = asyncio.get_running_loop().create_future()
    poll.hold(future)
    await asyncio.sleep(0.1)
    assert poll.polls > 0
    stopped = poll.polls
    await asyncio.sleep(0.02)
    assert poll.polls == stopped  # stopped at its budget, the future still pending
    future.cancel()


async def test_no_budget_no_polling() -> None:
    poll = BusyPoll(0.0)
    future = asyncio.get_running_loop().create_future()
    poll.hold(future)
    await asyncio.sleep(0.02)
    assert poll.polls == 0
    future.cancel()


async def _wait_for_late_message(busy_poll_us: int | None, count: int = 4) -> int:
    async with tcp_world(2, busy_poll_us=busy_poll_us) as (a, b):
        receive = b.irecv(0, tag=Tag(0, 1), out=np.zeros(count))

        async def late_send() -> None:
            await asyncio.sleep(0.03)
            await a.send(1, np.ones(count), tag=Tag(0, 1))

        sender = asyncio.create_task(late_send())
        async with asyncio.timeout(10):
            assert (await receive.wait()).sum() == count
            await sender
        return b.poll.polls


async def test_the_mesh_polls_as_configured() -> None:
    assert await _wait_for_late_message(20_000) > 10
    assert await _wait_for_late_message(0) == 0


async def test_only_small_receives_poll() -> None:
    assert await _wait_for_late_message(20_000, POLL_MAX_BYTES // 8) > 10
    assert await _wait_for_late_message(20_000, POLL_MAX_BYTES // 8 + 1) == 0


async def test_the_mesh_default_follows_the_rule() -> None:
    async with tcp_world(2) as (a, _b):
        assert a.poll.budget == default_budget(2, usable_cpus(), None)
        assert a.poll.yield_cpu is (2 > usable_cpus())


def test_the_setting_is_read_from_the_environment() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert WorkerConfig.from_env(env).busy_poll_us is None
    assert WorkerConfig.from_env({**env, "SHARDWIRE_BUSY_POLL_US": "250"}).busy_poll_us == 250


async def test_the_setting_reaches_the_transport() -> None:
    async with coordinator(2) as server:

        async def worker(i: int) -> float:
            async with init(worker_config(server, 2, i, busy_poll_us=250 + i)) as pg:
                await pg.barrier()
                return pg.transport.poll.budget

        budgets = await asyncio.wait_for(asyncio.gather(worker(0), worker(1)), 60)
        assert sorted(budgets) == pytest.approx([250e-6, 251e-6])


async def test_a_node_with_more_ranks_than_cpus_is_crowded() -> None:
    async with tcp_world(3) as meshes:
        for mesh in meshes:
            assert mesh.topology.crowded is (3 > usable_cpus())
            assert mesh.poll.yield_cpu is mesh.topology.crowded
