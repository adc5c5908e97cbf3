"""The coordinator server over loopback: scale, hostile input and refusals."""

from __future__ import annotations

import asyncio
import random

import pytest
from pydantic import ValidationError

from shardwire.coordinator import JobState
from shardwire.protocol import PROTOCOL_VERSION, ClientHandshake, Token
from shardwire.protocol.frames import MAGIC, PREFIX
from shardwire.protocol.messages import Error, Proof
from shardwire.protocol.placement import Placement
from tests.isolation import RUN_ID
from tests.worker.cluster import TOKEN, coordinator

from .rawclient import RawClient
from .test_rendezvous import join


async def test_256_workers_join_concurrently() -> None:
    world, lws = 256, 8
    async with coordinator(world) as server:

        async def one(i: int) -> Placement:
            client = await RawClient.open(server.address)
            try:
                await client.authenticate(TOKEN)
                client.send(join(f"node{i // lws:03d}", i % lws, world=world, lws=lws))
                msg = await client.recv(timeout=30)
                assert isinstance(msg, Placement)
                return msg
            finally:
                client.close()

        order = list(range(world))
        random.Random(0).shuffle(order)
        placed = await asyncio.gather(*(one(i) for i in order))
        assert sorted(p.rank for p in placed) == list(range(world))
        for i, place in zip(order, placed, strict=True):
            assert place.rank == i and place.world_size == world  # node ids sort like i


async def test_wrong_token_admits_no_one() -> None:
    async with coordinator(1) as server:
        client = await RawClient.open(server.address)
        shake = ClientHandshake(Token("wrong"), role="worker", run_id=RUN_ID)
        client.send(shake.hello)
        await client.recv()  # the challenge; we cannot verify it and answer with junk
        client.send(Proof(proof="ab" * 32))
        reply = await client.recv()
        assert isinstance(reply, Error) and reply.code == "auth"
        assert "token does not match" in reply.message
        assert "cluster-token" not in reply.message
        client.send(join("a", 0, world=1, lws=1))
        assert await client.closed_by_server()
        assert server.rendezvous.state is JobState.WAITING


async def test_replayed_handshake_admits_no_one() -> None:
    async with coordinator(2) as server:
        honest = await RawClient.open(server.address)
        await honest.authenticate(TOKEN)
        recorded_hello, recorded_proof = honest.sent  # what an eavesdropper saw
        assert isinstance(recorded_proof, Proof)
        replay = await RawClient.open(server.address)
        replay.send(recorded_hello)
        await replay.recv()
        replay.send(recorded_proof)
        reply = await replay.recv()
        assert isinstance(reply, Error) and reply.code == "auth"
        honest.close()


async def test_version_mismatch_is_reported_in_plain_words() -> None:
    async with coordinator(1) as server:
        client = await RawClient.open(server.address)
        client.writer.write(PREFIX.pack(MAGIC, PROTOCOL_VERSION + 1, 3, 10, 0) + b"\x80" * 10)
        reply = await client.recv()
        assert isinstance(reply, Error) and reply.code == "version"
        assert (
            f"this side speaks version {PROTOCOL_VERSION}, the other side speaks version "
            f"{PROTOCOL_VERSION + 1}"
        ) in reply.message


@pytest.mark.slow
async def test_keeps_serving_after_1000_malformed_connections() -> None:
    rng = random.Random(7)
    payloads = [
        lambda: bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))),
        lambda: PREFIX.pack(MAGIC, PROTOCOL_VERSION, 1, 2**31, 0),
        lambda: PREFIX.pack(MAGIC, PROTOCOL_VERSION, 2, 4, 2**63) + b"abcd",
        lambda: PREFIX.pack(b"XX", PROTOCOL_VERSION, 1, 0, 0),
        lambda: PREFIX.pack(MAGIC, PROTOCOL_VERSION, 3, 3, 0) + b"\xc1\xc1\xc1",
        lambda: b"",
    ]
    async with coordinator(1) as server:
        gate = asyncio.Semaphore(64)

        async def hostile(i: int) -> None:
            async with gate:
                client = await RawClient.open(server.address)
                client.writer.write(payloads[i % len(payloads)]())
                if i % 2:
                    client.close()
                    return
                await client.writer.drain()
                client.writer.write_eof()
                await client.closed_by_server()
                client.close()

        await asyncio.gather(*(hostile(i) for i in range(1000)))
        legit = await RawClient.open(server.address)
        await legit.authenticate(TOKEN)
        legit.send(join("a", 0, world=1, lws=1))
        assert isinstance(await legit.recv(), Placement)


async def test_connections_over_the_unauthenticated_cap_are_closed_on_arrival() -> None:
    from shardwire.coordinator import CoordinatorServer, RendezvousConfig, ServerConfig

    server = CoordinatorServer(
        ServerConfig(
            RendezvousConfig(run_id=RUN_ID, world_size=1),
            max_unauthenticated=3,
            handshake_timeout=0.5,
        ),
        TOKEN,
    )
    await server.start("127.0.0.1", 0)
    idle: list[RawClient] = []
    try:
        idle = [await RawClient.open(server.address) for _ in range(3)]
        extra = await RawClient.open(server.address)
        busy = await extra.recv(timeout=5)  # told why, so that a worker retries
        assert isinstance(busy, Error) and busy.code == "busy"
        assert await extra.closed_by_server(timeout=5)
        for client in idle:  # the deadline frees their slots
            assert await client.closed_by_server(timeout=5)
        legit = await RawClient.open(server.address)
        await legit.authenticate(TOKEN)
        legit.send(join("a", 0, world=1, lws=1))
        assert isinstance(await legit.recv(), Placement)
        legit.close()
    finally:
        for client in idle:
            client.close()
        await server.aclose()


async def test_a_ticker_that_dies_ends_the_server_and_its_error_reaches_aclose() -> None:
    from shardwire.coordinator import CoordinatorServer, RendezvousConfig, ServerConfig

    server = CoordinatorServer(
        ServerConfig(RendezvousConfig(run_id=RUN_ID, world_size=1), tick_interval=0.01), TOKEN
    )

    def broken(now: float):
        raise RuntimeError("tick failed")

    server.rendezvous.tick = broken  # type: ignore[method-assign]
    await server.start("127.0.0.1", 0)
    await asyncio.wait_for(server.done.wait(), 10)  # not silent: the server is done
    with pytest.raises(RuntimeError, match="tick failed"):
        await server.aclose()


async def test_a_burst_of_workers_over_the_handshake_cap_all_join_by_retrying() -> None:
    from shardwire.coordinator import CoordinatorServer, RendezvousConfig, ServerConfig
    from shardwire.worker.runtime.control import ControlClient

    world, lws = 96, 8
    server = CoordinatorServer(
        ServerConfig(
            RendezvousConfig(run_id=RUN_ID, world_size=world),
            max_unauthenticated=4,
            handshake_timeout=1.0,
        ),
        TOKEN,
    )
    await server.start("127.0.0.1", 0)
    # every slot held by a silent client until its handshake deadline: every first
    # attempt of the burst is told "busy"
    idle = [await RawClient.open(server.address) for _ in range(4)]
    clients = [ControlClient(token=TOKEN, run_id=RUN_ID, role="worker") for _ in range(world)]

    async def one(i: int) -> Placement:
        await clients[i].connect(*server.address, timeout=60)
        return await clients[i].join(
            join(f"node{i // lws:03d}", i % lws, world=world, lws=lws), timeout=60
        )

    try:
        rosters = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(world))), 120)
        assert sorted(r.rank for r in rosters) == list(range(world))
    finally:
        for client in clients:
            await client.aclose()
        for raw in idle:
            raw.close()
        await server.aclose()


async def test_one_message_sent_to_many_is_encoded_once(monkeypatch) -> None:
    from shardwire.coordinator import CoordinatorServer, RendezvousConfig, Send, ServerConfig
    from shardwire.coordinator import server as module
    from shardwire.coordinator.connection import ControlConnection
    from shardwire.protocol.messages import Abort

    class Transport:  # what asyncio hands a protocol; keeps what is written
        def __init__(self) -> None:
            self.data: list[bytes] = []

        def get_extra_info(self, _name: str):
            return ("127.0.0.1", 1)

        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            self.data.append(data)

        def close(self) -> None:
            self.closed = True

    server = CoordinatorServer(ServerConfig(RendezvousConfig(run_id=RUN_ID, world_size=1)), TOKEN)
    transports = [Transport() for _ in range(1000)]
    ids = []
    for transport in transports:
        conn = ControlConnection(server, TOKEN, handshake_timeout=60, idle_timeout=60)
        conn.connection_made(transport)  # type: ignore[arg-type]
        server.authenticated(conn)  # as after its handshake
        ids.append(conn.id)
    calls = []
    encode = module.message_bytes
    monkeypatch.setattr(module, "message_bytes", lambda m: calls.append(m) or encode(m))
    abort = Abort(rank=3, reason="rank 3 failed", stacks="x" * 8000)
    server.apply([Send(i, abort) for i in ids])
    assert len(calls) == 1
    assert all(t.data == [encode(abort)] for t in transports)
    await server.aclose()


async def _join_all(server, world: int, lws: int, prefix: str) -> tuple[list[RawClient], list]:
    """``world`` raw workers joined on nodes ``prefix0000``...; their clients and what each
    received (the placement, once the job formed)."""
    joined = []
    for i in range(world):
        client = await RawClient.open(server.address)
        await client.authenticate(TOKEN)
        client.send(join(f"{prefix}{i // lws:04d}", i % lws, world=world, lws=lws))
        joined.append(client)
    return joined, [await c.recv(timeout=60) for c in joined]


async def test_status_of_a_job_too_large_for_one_frame_comes_page_by_page() -> None:
    from shardwire.protocol import FrameTooLarge
    from shardwire.protocol.control import message_bytes
    from shardwire.protocol.frames import MAX_META_BYTES
    from shardwire.protocol.messages import STATUS_PAGE, StatusRequest
    from shardwire.worker.runtime.control import ControlClient

    world, lws = 700, 10
    async with coordinator(world) as server:
        joined, placed = await _join_all(server, world, lws, "host-with-a-long-name-")
        assert all(isinstance(p, Placement) for p in placed)
        with pytest.raises(FrameTooLarge):  # one reply could not carry every row
            message_bytes(server.rendezvous.status(0.0))
        page = server.rendezvous.status(0.0, 600, STATUS_PAGE)
        assert [r.rank for r in page.ranks] == list(range(600, 700)) and page.total == world
        assert len(message_bytes(server.rendezvous.status(0.0, 0, STATUS_PAGE))) < MAX_META_BYTES
        with pytest.raises(ValidationError, match="limit\n  Input should be less than or equal to"):
            StatusRequest(limit=STATUS_PAGE + 1)
        monitor = ControlClient(token=TOKEN, run_id=RUN_ID, role="client")
        try:
            await monitor.connect(*server.address, timeout=30)
            reply = await monitor.status(timeout=30)
        finally:
            await monitor.aclose()
        assert [r.rank for r in reply.ranks] == list(range(world)) and reply.total == world
        for client in joined:
            client.close()


async def test_a_thousand_workers_form_a_job_with_no_message_growing_with_it() -> None:
    from shardwire.protocol.placement import PEER_PAGE, PeerPage, PeerQuery

    world, lws = 1000, 8
    async with coordinator(world) as server:
        joined, placed = await _join_all(server, world, lws, "n")
        assert sorted(p.rank for p in placed) == list(range(world))
        asker, members = joined[-1], []
        for start in range(0, world, PEER_PAGE):
            asker.send(PeerQuery(ranks=list(range(start, min(world, start + PEER_PAGE)))))
            page = await asker.recv(timeout=30)
            assert isinstance(page, PeerPage) and len(page.members) <= PEER_PAGE
            members += page.members
        assert [m.rank for m in members] == list(range(world))
        assert [m.port for m in members[:3]] == [1000, 1001, 1002]
        asker.send(PeerQuery(ranks=[world]))  # beyond the world: refused, named
        refusal = await asker.recv(timeout=30)
        assert isinstance(refusal, Error) and "beyond the world of 1000" in refusal.message
        for client in joined:
            client.close()
