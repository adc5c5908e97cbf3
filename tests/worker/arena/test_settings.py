"""The arena's settings, from the environment to the group: the slot size, and
``SHARDWIRE_TRANSPORT=tcp`` turning arenas off."""

from __future__ import annotations

import asyncio

import numpy as np

from shardwire.worker import WorkerConfig, init
from shardwire.worker.arena import DEFAULT_SLOT_BYTES
from tests.worker.cluster import coordinator, worker_config

ENV = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}


def test_the_slot_size_is_read_from_the_environment() -> None:
    assert WorkerConfig.from_env(ENV).arena_slot_bytes == DEFAULT_SLOT_BYTES
    env = {**ENV, "SHARDWIRE_ARENA_SLOT_BYTES": str(1 << 18)}
    assert WorkerConfig.from_env(env).arena_slot_bytes == 1 << 18


async def _opened(transport: str, slot: int) -> list[int | None]:
    async with coordinator(2) as server:

        async def worker(i: int) -> int | None:
            config = worker_config(server, 2, i, transport=transport, arena_slot_bytes=slot)
            async with init(config) as pg:
                out = await pg.all_reduce(np.full(8, i + 1.0))
                assert out.tolist() == [3.0] * 8
                gate = getattr(pg.backend, "gate", None)
                return gate.arena.region.geometry.slot_bytes if gate and gate.arena else None

        return list(await asyncio.wait_for(asyncio.gather(worker(0), worker(1)), 60))


async def test_the_slot_size_reaches_the_arena_and_tcp_turns_it_off() -> None:
    on = await _opened("auto", 1 << 18)
    assert on == [1 << 18, 1 << 18]
    off = await _opened("tcp", 1 << 18)
    assert off == [None, None]
