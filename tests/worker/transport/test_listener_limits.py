"""The peer listener bounds what an unauthenticated client can hold: a handshake
deadline, a cap on connections still in their handshake, one held message each."""

from __future__ import annotations

import asyncio

import numpy as np

from shardwire.protocol import ClientHandshake, Tag
from shardwire.protocol.messages import Error
from shardwire.worker.transport import MeshConfig, TcpMesh
from tests.coordinator.rawclient import RawClient

from .fabric import TOKEN, start_all


def _mesh(**config) -> TcpMesh:
    return TcpMesh(MeshConfig(run_id="test", token=TOKEN, **config), timeout=10)


async def test_a_silent_connection_is_closed_at_the_handshake_deadline() -> None:
    mesh = _mesh(handshake_timeout=0.3)
    try:
        port = await mesh.listen()
        idle = await RawClient.open(("127.0.0.1", port))
        assert await idle.closed_by_server(timeout=5)  # nothing sent: dropped after 0.3 s
        assert mesh.handshaking() == 0
    finally:
        await mesh.aclose()


async def test_connections_over_the_cap_are_closed_and_peers_still_connect() -> None:
    meshes = [_mesh(max_unauthenticated=4, handshake_timeout=0.5), _mesh()]
    idle: list[RawClient] = []
    try:
        ports = [await m.listen() for m in meshes]
        idle = [await RawClient.open(("127.0.0.1", ports[0])) for _ in range(4)]
        extra = await RawClient.open(("127.0.0.1", ports[0]))
        busy = await extra.recv(timeout=5)  # told why, so that a dialling rank retries
        assert isinstance(busy, Error) and busy.code == "busy"
        assert await extra.closed_by_server(timeout=5)
        for client in idle:  # the deadline frees their slots
            assert await client.closed_by_server(timeout=5)
        start_all(meshes, ports)
        got, _ = await asyncio.gather(
            meshes[0].recv(1, tag=Tag(0, 0)), meshes[1].send(0, np.arange(3.0), tag=Tag(0, 0))
        )
        assert got.tolist() == [0.0, 1.0, 2.0]
    finally:
        for client in idle:
            client.close()
        for m in meshes:
            await m.aclose()


async def test_ranks_dialling_a_listener_in_too_many_handshakes_retry_until_in() -> None:
    n = 12
    meshes = [_mesh(max_unauthenticated=1, handshake_timeout=1.0, connect_timeout=60)]
    meshes += [_mesh(connect_timeout=60) for _ in range(n - 1)]
    idle: RawClient | None = None
    try:
        ports = [await m.listen() for m in meshes]
        idle = await RawClient.open(("127.0.0.1", ports[0]))  # holds rank 0's one slot
        start_all(meshes, ports)
        async with asyncio.timeout(60):  # every first dial to rank 0 is told "busy"
            got = await asyncio.gather(
                *(meshes[0].recv(r, tag=Tag(0, r)) for r in range(1, n)),
                *(meshes[r].send(0, np.array([r]), tag=Tag(0, r)) for r in range(1, n)),
            )
        assert [int(x[0]) for x in got[: n - 1]] == list(range(1, n))
    finally:
        if idle is not None:
            idle.close()
        for m in meshes:
            await m.aclose()


async def test_a_second_handshake_message_before_the_reply_is_refused() -> None:
    mesh = _mesh()  # no roster yet: the listener holds the client's hello
    try:
        port = await mesh.listen()
        client = await RawClient.open(("127.0.0.1", port))
        shake = ClientHandshake(TOKEN, role="peer", run_id="test", rank=1, generation=1)
        client.send(shake.hello)
        client.send(shake.hello)
        assert await client.closed_by_server(timeout=5)
        assert mesh.handshaking() == 0
    finally:
        await mesh.aclose()
