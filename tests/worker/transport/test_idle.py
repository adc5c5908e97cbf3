"""Idle connections close (both ranks agreeing) and the next send dials again; nothing
sent around a release is lost, and a release is never a failure."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from shardwire.protocol import Tag
from tests.waiting import until as _until

from .fabric import tcp_world


async def test_an_idle_connection_closes_and_the_next_send_dials_again() -> None:
    async with tcp_world(2, idle_close=0.2) as (a, b):
        got, _ = await asyncio.gather(
            b.recv(0, tag=Tag(0, 0)), a.send(1, np.arange(3.0), tag=Tag(0, 0))
        )
        assert a.peers() == [1] and b.peers() == [0]
        await _until(lambda: a.peers() == [] and b.peers() == [])
        assert a.idle.released == b.idle.released == 1
        await _until(lambda: not a.idle.retired and not b.idle.retired)  # both sides closed
        got, _ = await asyncio.gather(
            a.recv(1, tag=Tag(0, 1)), b.send(0, np.arange(4.0), tag=Tag(0, 1))
        )
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0] and a.error is None and b.error is None
        assert a.links.dials + b.links.dials == 2  # one dial each way, at first use


async def test_only_a_connection_quiet_for_a_whole_sweep_period_is_released() -> None:
    async with tcp_world(2, idle_close=3600) as (a, b):  # sweeps by hand below
        for i in range(5):  # a message between every two sweeps: kept
            await asyncio.gather(b.recv(0, tag=Tag(0, i)), a.send(1, np.ones(2), tag=Tag(0, i)))
            a.idle.sweep()
            b.idle.sweep()
        await asyncio.sleep(0.1)
        conn = a.connection(1)
        assert a.peers() == [1] and conn is not None and not conn.releasing
        a.idle.sweep()  # nothing moved since the last sweep: proposed
        assert conn.releasing
        await _until(lambda: a.peers() == [] and b.peers() == [])
        assert (a.idle.released, b.idle.released) == (1, 1)


async def test_messages_around_releases_all_arrive_in_order() -> None:
    rng = random.Random(7)
    async with tcp_world(3, idle_close=0.1, timeout=30) as meshes:
        for i in range(40):  # pauses around the idle time: sends race the releases
            src, dst = rng.sample(range(3), 2)
            payload = np.full(rng.choice([1, 5000, 200_000]), i, np.int32)
            got, _ = await asyncio.gather(
                meshes[dst].recv(src, tag=Tag(0, i)),
                meshes[src].send(dst, payload, tag=Tag(0, i)),
            )
            assert got.size == payload.size and int(got[0]) == i
            await asyncio.sleep(rng.choice([0.0, 0.04, 0.06, 0.12]))
        assert all(m.error is None for m in meshes)
        assert sum(m.idle.released for m in meshes) > 0
