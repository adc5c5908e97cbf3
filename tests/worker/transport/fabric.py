"""Builders for N connected transports of either kind, inside one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator

import pytest

from shardwire.protocol import Token
from shardwire.protocol.placement import Placement
from shardwire.worker.transport import AddressBook, MemoryHub, MeshConfig, TcpMesh, Transport
from tests.isolation import RUN_ID

TOKEN = Token("test-token")


def free_port_range(count: int) -> tuple[int, int]:
    """``count`` consecutive ports nothing listens on, below the kernel's ephemeral range
    (so no connection of another test lands on them meanwhile). Each test process starts
    its search at a place of its own, so that two processes probing at once do not both
    take the first free range."""
    lows = list(range(21000, 29000, 97))
    start = os.getpid() % len(lows)
    for low in lows[start:] + lows[:start]:
        with contextlib.ExitStack() as stack:
            try:
                for port in range(low, low + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return low, low + count - 1
    pytest.skip(f"no {count} consecutive free ports on 127.0.0.1 between 21000 and 29000")


@contextlib.asynccontextmanager
async def memory_world(n: int, *, timeout: float = 10.0) -> AsyncIterator[list[Transport]]:
    hub = MemoryHub(n, timeout=timeout)
    transports: list[Transport] = [hub.endpoint(r) for r in range(n)]
    try:
        yield transports
    finally:
        for t in transports:
            await t.aclose()


def placement_for(
    world: int, rank: int, generation: int = 1, *, per_node: int | None = None
) -> Placement:
    """Rank ``rank``'s placement: ``per_node`` ranks on each node (all on one by default)."""
    per_node = per_node or world
    return Placement(
        rank=rank,
        world_size=world,
        generation=generation,
        local_rank=rank % per_node,
        local_world_size=per_node,
        node_rank=rank // per_node,
    )


def book_for(ports: list[int]) -> AddressBook:
    """Every rank listening on loopback at ``ports[rank]``."""
    return AddressBook.fixed({r: ("127.0.0.1", p) for r, p in enumerate(ports)})


def start_all(
    meshes: list[TcpMesh],
    ports: list[int],
    *,
    generation: int = 1,
    per_node: int | None = None,
    nodes: list[int] | None = None,
) -> None:
    """Give every mesh its place; rank r listens at ``ports[r]``. ``nodes``: rank r on
    simulated node ``nodes[r]`` (ranks need not be contiguous per node then)."""
    n = len(meshes)
    for r, m in enumerate(meshes):
        if nodes is not None:
            place = placement_for(n, r, generation, per_node=nodes.count(nodes[r]))
            m.start(place, book_for(ports), nodes=nodes)
        else:
            m.start(placement_for(n, r, generation, per_node=per_node), book_for(ports))


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
            MeshConfig(run_id=RUN_ID, token=token, shm=shm, **config),  # type: ignore[arg-type]
            timeout=timeout,
            max_early_bytes=max_early_bytes,
        )
        for _ in range(n)
    ]
    try:
        ports = [await m.listen() for m in meshes]
        start_all(meshes, ports, per_node=per_node, nodes=nodes)
        yield list(meshes)
    finally:
        for m in meshes:
            await m.aclose()


async def connect_all(transports: list[Transport]) -> None:
    """Connect every pair of TCP ranks now (as if each had sent to each), so that a
    rank's death shows as its connections closing."""
    meshes = [t for t in transports if isinstance(t, TcpMesh)]
    async with asyncio.timeout(30):
        await asyncio.gather(*(m.ensure(range(m.rank + 1, len(meshes))) for m in meshes))


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
