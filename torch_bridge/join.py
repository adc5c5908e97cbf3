"""Joining a job from torch: through shardwire's coordinator, or through torch's store.

Under ``shardwire launch`` / ``shardwire worker`` the coordinator places the rank and
answers address lookups, exactly as for a shardwire script (authentication, liveness,
hang diagnosis and the root-cause summary come with it).

Started the way torch starts groups (torchrun, ``env://``, ``tcp://``, ``file://`` or a
store passed in) there is no coordinator: the ranks meet through the store torch hands
the backend. Rank 0 draws the job's secret (it authenticates every peer connection) and
its run id (it names the shared memory) and puts them in the store; every rank then puts
``host|port|node`` there and reads everyone's. So each rank holds the whole address list
and node map: O(n) per rank, as torch's own backends hold it. Ranks with the same node
id (``SHARDWIRE_NODE_ID``, else the host name) share shared memory and the node arena.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwire.protocol import PeerFailed, Token
from shardwire.protocol.auth import is_loopback
from shardwire.protocol.placement import Placement
from shardwire.worker.api import Session, mesh_config
from shardwire.worker.collectives import Group
from shardwire.worker.collectives.process import ProcessGroup
from shardwire.worker.runtime.worker_config import WorkerConfig
from shardwire.worker.transport.book import AddressBook
from shardwire.worker.transport.mesh import TcpMesh

Close = Callable[[BaseException | None], Coroutine[Any, Any, None]]
Reform = Callable[[BaseException], Coroutine[Any, Any, "Joined"]]

_KEY = "shardwire/"


@dataclass(frozen=True)
class Joined:
    """A mesh this process joined: its world group, the torch global ranks of that world
    (in order), and how to leave (with the error the process is failing with, if any)."""

    world: Group
    ranks: list[int]
    close: Close
    # through the coordinator: leave the generation a failure ended and join the next in
    # this process (live recovery; the session says why not, otherwise); None: a store's
    reform: Reform | None = None


async def through_coordinator(config: WorkerConfig) -> Joined:
    session = Session(config)
    group = await session.__aenter__()

    async def close(error: BaseException | None) -> None:
        if error is None:
            await session.__aexit__(None, None, None)
        else:
            await session.__aexit__(type(error), error, error.__traceback__)

    def joined(world: Group) -> Joined:
        async def reform(error: BaseException) -> Joined:
            return joined(await session.reform(error))

        return Joined(world, list(range(world.size)), close, reform)

    return joined(group)


async def through_store(
    store: dist.Store, *, rank: int, size: int, ranks: list[int], config: WorkerConfig
) -> Joined:
    secret, run_id = await asyncio.to_thread(_shared_secret, store, rank)
    mesh: TcpMesh

    def peer_failed(error: PeerFailed) -> None:
        # no coordinator tells the others: fail every call of this rank, and the poison
        # relay of each failed group carries it to the ranks that wait on this one
        asyncio.get_running_loop().call_soon(mesh.abort, error)

    mesh = TcpMesh(
        mesh_config(config, run_id=run_id, token=Token(secret)),
        timeout=config.timeout,
        on_peer_failed=peer_failed,
    )
    try:
        port = await mesh.listen()
        mine = f"{_advertised(config)}|{port}|{config.node_id}"
        records = await asyncio.to_thread(_exchange, store, rank, size, mine)
        addresses, nodes = _parse(records)
        node_of = {node: i for i, node in enumerate(dict.fromkeys(nodes))}
        local = [r for r in range(size) if nodes[r] == nodes[rank]]
        place = Placement(
            rank=rank,
            world_size=size,
            generation=0,
            local_rank=local.index(rank),
            local_world_size=len(local),
            node_rank=node_of[nodes[rank]],
        )
        mesh.start(place, AddressBook.fixed(addresses), nodes=[node_of[n] for n in nodes])
        group = ProcessGroup(
            mesh,
            local_rank=place.local_rank,
            local_world_size=place.local_world_size,
            node_rank=place.node_rank,
            generation=0,
            timeout=config.timeout,
        )
    except BaseException:
        await mesh.aclose()
        raise

    async def close(_error: BaseException | None) -> None:
        try:
            await group.aclose()
        finally:
            await mesh.aclose()

    return Joined(group, ranks, close)


def _shared_secret(store: dist.Store, rank: int) -> tuple[str, str]:
    if rank == 0:
        store.set(_KEY + "secret", secrets.token_hex(32))
        store.set(_KEY + "run", "t" + secrets.token_hex(8))
    return store.get(_KEY + "secret").decode(), store.get(_KEY + "run").decode()


def _exchange(store: dist.Store, rank: int, size: int, mine: str) -> list[str]:
    store.set(f"{_KEY}peer/{rank}", mine)
    # one round trip; every store of torch >= 2.7 has it (a timeout here is the store's,
    # and is not retried key by key)
    values = store.multi_get([f"{_KEY}peer/{r}" for r in range(size)])
    return [bytes(v).decode() for v in values]


def _parse(records: list[str]) -> tuple[dict[int, tuple[str, int]], list[str]]:
    addresses: dict[int, tuple[str, int]] = {}
    nodes: list[str] = []
    for r, record in enumerate(records):
        host, port, node = record.split("|", 2)
        addresses[r] = (host, int(port))
        nodes.append(node)
    return addresses, nodes


def _advertised(config: WorkerConfig) -> str:
    """The address the other ranks dial: the configured one, the bind address, or the
    interface that routes to the rendezvous host (a UDP "connect" sends nothing)."""
    if config.advertise_host:
        return config.advertise_host
    if config.bind_host not in ("0.0.0.0", "::", ""):
        return config.bind_host
    host = config.coordinator[0]
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])
