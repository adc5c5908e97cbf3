"""Builders for N connected transports of either kind, inside one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shardwire.protocol import Token
from shardwire.protocol.placement import Member, Roster
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


def roster_for(
    ports: list[int],
    rank: int,
    generation: int = 1,
    *,
    per_node: int | None = None,
    nodes: list[int] | None = None,
) -> Roster:
    """Every rank on one node, ``per_node`` ranks on each of several simulated nodes, or
    rank r on simulated node ``nodes[r]``."""
    per_node = per_node or len(ports)
    node_of = nodes or [r // per_node for r in range(len(ports))]
    members = [
        Member(
            rank=r,
            node_id=f"node-{node_of[r]}",
            node_rank=node_of[r],
            local_rank=node_of[:r].count(node_of[r]),
            host="127.0.0.1",
            port=p,
        )
        for r, p in enumerate(ports)
    ]
    return Roster(rank=rank, world_size=len(ports), generation=generation, members=members)


@contextlib.asynccontextmanager
async def tcp_world(
    n: int,
    *,
    timeout: float = 10.0,
    token: Token = TOKEN,
    max_early_bytes: int = 1 << 30,
    shm: bool = False,
    per_node: int | None = None,
    nodes: list[int] | None = None,
    **config: object,
) -> AsyncIterator[list[TcpMesh]]:
    meshes = [
        TcpMesh(
            MeshConfig(run_id="test", token=token, shm=shm, **config),  # type: ignore[arg-type]
            timeout=timeout,
            max_early_bytes=max_early_bytes,
        )
        for _ in range(n)
    ]
    try:
        ports = [await m.listen() for m in meshes]
        async with asyncio.timeout(10):
            await asyncio.gather(
                *(
                    m.connect(roster_for(ports, r, per_node=per_node, nodes=nodes))
                    for r, m in enumerate(meshes)
                )
            )
        yield list(meshes)
    finally:
        for m in meshes:
            await m.aclose()


def shm_world(n: int, **kwargs: object) -> contextlib.AbstractAsyncContextManager:
    """One node, as ``SHARDWIRE_TRANSPORT=auto`` runs it: groups run their collectives
    through a node arena, other payloads of 128 KiB and more use per-pair segments."""
    return tcp_world(n, shm=True, arena=True, **kwargs)  # type: ignore[arg-type]


def mixed_world(n: int, **kwargs: object) -> contextlib.AbstractAsyncContextManager:
    """Simulated nodes of two ranks: shared memory inside a node (node groups on their
    arena), TCP across nodes."""
    return tcp_world(n, shm=True, arena=True, per_node=2, **kwargs)  # type: ignore[arg-type]


def pairs_world(n: int, **kwargs: object) -> contextlib.AbstractAsyncContextManager:
    """One node with the arena off: per-pair segments only (the path of a group whose
    arena could not be made)."""
    return tcp_world(n, shm=True, **kwargs)  # type: ignore[arg-type]


WORLDS = {"memory": memory_world, "tcp": tcp_world, "shm": shm_world, "mixed": mixed_world}
# Worlds that only some tests need, by the same names.
EXTRA_WORLDS = {"pairs": pairs_world}


async def close_all(*closeables_lists: list) -> None:
    """Close groups, then transports, then helpers (each list in order)."""
    for closeables in closeables_lists:
        for item in closeables:
            await item.aclose()
