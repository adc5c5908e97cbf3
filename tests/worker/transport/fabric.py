"""Builders for N connected transports of either kind, inside one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shardwire.protocol import Token
from shardwire.protocol.messages import Member, Roster
from shardwire.worker.transport import MemoryHub, MeshConfig, TcpMesh, Transport

TOKEN = Token("test-token")


@contextlib.asynccontextmanager
async def memory_world(n: int, *, timeout: float = 10.0) -> AsyncIterator[list[Transport]]:
    hub = MemoryHub(n, timeout=timeout)
    transports: list[Transport] = [hub.endpoint(r) for r in range(n)]
    try:
        yield transports
    finally:
        for t in transports:
            await t.aclose()


def roster_for(ports: list[int], rank: int, generation: int = 1) -> Roster:
    members = [
        Member(rank=r, node_id="local", node_rank=0, local_rank=r, host="127.0.0.1", port=p)
        for r, p in enumerate(ports)
    ]
    return Roster(rank=rank, world_size=len(ports), generation=generation, members=members)


@contextlib.asynccontextmanager
async def tcp_world(
    n: int, *, timeout: float = 10.0, token: Token = TOKEN, max_early_bytes: int = 1 << 30
) -> AsyncIterator[list[Transport]]:
    meshes = [
        TcpMesh(
            MeshConfig(run_id="test", token=token), timeout=timeout, max_early_bytes=max_early_bytes
        )
        for _ in range(n)
    ]
    try:
        ports = [await m.listen() for m in meshes]
        async with asyncio.timeout(10):
            await asyncio.gather(*(m.connect(roster_for(ports, r)) for r, m in enumerate(meshes)))
        yield list(meshes)
    finally:
        for m in meshes:
            await m.aclose()


WORLDS = {"memory": memory_world, "tcp": tcp_world}


async def close_all(*closeables_lists: list) -> None:
    """Close groups, then transports, then helpers (each list in order)."""
    for closeables in closeables_lists:
        for item in closeables:
            await item.aclose()
