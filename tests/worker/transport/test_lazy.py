"""Connections on first use: none at start, one per pair that talks (whichever side
dials first), addresses asked once per loop turn, and typed failures naming the peer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import CollectiveTimeout, PeerFailed, Tag, Token
from shardwire.protocol.placement import Member
from shardwire.worker.transport import AddressBook, ConnectFailed, MeshConfig, TcpMesh

from .fabric import TOKEN, book_for, placement_for, tcp_world


def _inbound(mesh: TcpMesh, peer: int) -> bool:
    conn = mesh.connection(peer)
    assert conn is not None
    return conn.accepted


async def test_nothing_is_dialled_until_a_rank_sends() -> None:
    async with tcp_world(4) as meshes:
        await asyncio.sleep(0.1)
        assert all(m.peers() == [] for m in meshes)
        got, _ = await asyncio.gather(
            meshes[2].recv(1, tag=Tag(0, 0)), meshes[1].send(2, np.arange(3.0), tag=Tag(0, 0))
        )
        assert got.tolist() == [0.0, 1.0, 2.0]
        assert [m.peers() for m in meshes] == [[], [2], [1], []]
        assert _inbound(meshes[2], 1) and not _inbound(meshes[1], 2)  # the sender dialled


async def test_ranks_sending_to_each_other_at_once_share_one_connection_per_pair() -> None:
    n = 6
    async with tcp_world(n) as meshes:
        x = np.arange(1000.0)

        async def talk(m: TcpMesh) -> None:
            peers = [p for p in range(n) if p != m.rank]
            await asyncio.gather(
                *(m.send(p, x + m.rank, tag=Tag(0, m.rank)) for p in peers),
                *(m.recv(p, tag=Tag(0, p)) for p in peers),
            )

        async with asyncio.timeout(30):
            for _ in range(3):  # first sends cross; later ones reuse the connection
                await asyncio.gather(*(talk(m) for m in meshes))
        for m in meshes:
            assert m.peers() == [p for p in range(n) if p != m.rank]
        for a in range(n):
            for b in range(a + 1, n):  # exactly one of the two ends accepted it
                assert _inbound(meshes[a], b) != _inbound(meshes[b], a)
        assert all(m.handshaking() == 0 for m in meshes)


async def test_frames_sent_before_the_connection_is_up_arrive_in_order() -> None:
    async with tcp_world(2) as (a, b):
        for i in range(10):
            a.post(1, *_frame(a, i))  # queued behind the dial, in order
        sent = asyncio.ensure_future(a.send(1, np.array([10]), tag=Tag(0, 0)))
        await asyncio.sleep(0)
        for i in range(11, 20):
            a.post(1, *_frame(a, i))
        got = [int((await b.recv(0, tag=Tag(0, 0)))[0]) for _ in range(20)]
        assert got == list(range(20))
        await sent


def _frame(mesh: TcpMesh, value: int):
    from shardwire.protocol import TensorMeta

    array = np.array([value], np.int64)
    return TensorMeta.for_array(array, src=mesh.rank, tag=Tag(0, 0), op="p2p", generation=1), array


async def test_the_ranks_first_needed_in_one_loop_turn_are_asked_in_one_query() -> None:
    asked: list[list[int]] = []
    n = 8
    meshes = [TcpMesh(MeshConfig(run_id="test", token=TOKEN), timeout=10) for _ in range(n)]
    try:
        ports = [await m.listen() for m in meshes]

        async def lookup(ranks: list[int]) -> list[Member]:
            asked.append(list(ranks))
            return [
                Member(rank=r, node_id="n", node_rank=0, local_rank=r, host="127.0.0.1", port=p)
                for r, p in ((r, ports[r]) for r in ranks)
            ]

        meshes[0].start(placement_for(n, 0), AddressBook(lookup))
        for r in range(1, n):
            meshes[r].start(placement_for(n, r), book_for(ports))
        async with asyncio.timeout(30):
            await asyncio.gather(
                *(meshes[0].send(p, np.ones(4), tag=Tag(0, 0)) for p in range(1, n)),
                *(meshes[p].recv(0, tag=Tag(0, 0)) for p in range(1, n)),
            )
            await meshes[0].send(3, np.ones(4), tag=Tag(0, 1))  # cached: no second query
            await meshes[3].recv(0, tag=Tag(0, 1))
        assert asked == [[1, 2, 3, 4, 5, 6, 7]]
    finally:
        for m in meshes:
            await m.aclose()


async def test_a_peer_that_is_gone_fails_the_send_naming_it() -> None:
    blamed: list[PeerFailed] = []
    meshes = [
        TcpMesh(MeshConfig(run_id="test", token=TOKEN), timeout=30, on_peer_failed=blamed.append)
        for _ in range(2)
    ]
    try:
        ports = [await m.listen() for m in meshes]
        meshes[0].start(placement_for(2, 0), book_for(ports))
        await meshes[1].aclose()  # its listener is closed: nobody answers there
        with pytest.raises(PeerFailed, match=f"refused the connection at 127.0.0.1:{ports[1]}"):
            async with asyncio.timeout(10):  # not the 30 s send timeout
                await meshes[0].send(1, np.ones(3), tag=Tag(0, 0))
        assert [e.rank for e in blamed] == [1]
        with pytest.raises(PeerFailed):  # the mesh stays poisoned
            await meshes[0].send(1, np.ones(3), tag=Tag(0, 1))
    finally:
        await meshes[0].aclose()


async def test_a_peer_that_never_answers_the_handshake_fails_within_the_connect_timeout() -> None:
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    blamed: list[PeerFailed] = []
    mesh = TcpMesh(
        MeshConfig(run_id="test", token=TOKEN, connect_timeout=0.5),
        timeout=30,
        on_peer_failed=blamed.append,
    )
    try:
        await mesh.listen()
        mesh.start(placement_for(2, 0), AddressBook.fixed({1: ("127.0.0.1", port)}))
        with pytest.raises(PeerFailed, match=r"rank 1 at 127\.0\.0\.1:\d+ within 0\.5 s"):
            async with asyncio.timeout(10):
                await mesh.send(1, np.ones(3), tag=Tag(0, 0))
        assert [e.rank for e in blamed] == [1]
    finally:
        await mesh.aclose()
        silent.close()
        await silent.wait_closed()


async def test_a_peer_with_another_token_is_this_ranks_error_not_the_peers() -> None:
    blamed: list[PeerFailed] = []
    meshes = [
        TcpMesh(
            MeshConfig(run_id="test", token=token),
            timeout=30,
            on_peer_failed=blamed.append,
        )
        for token in (TOKEN, Token("another-token"))
    ]
    try:
        ports = [await m.listen() for m in meshes]
        for r, m in enumerate(meshes):
            m.start(placement_for(2, r), book_for(ports))
        with pytest.raises(ConnectFailed, match="cannot connect to rank 1"):
            async with asyncio.timeout(10):
                await meshes[0].ensure([1])
        assert blamed == []  # a refused handshake blames nobody
    finally:
        for m in meshes:
            await m.aclose()


async def test_a_ring_exchange_connects_each_rank_to_its_two_neighbours_only() -> None:
    n = 8
    async with tcp_world(n) as meshes:
        async with asyncio.timeout(30):
            await asyncio.gather(
                *(m.send((m.rank + 1) % n, np.ones(8), tag=Tag(0, 0)) for m in meshes),
                *(m.recv((m.rank - 1) % n, tag=Tag(0, 0)) for m in meshes),
            )
        for m in meshes:
            assert m.peers() == sorted({(m.rank + 1) % n, (m.rank - 1) % n})
        assert sum(m.links.dials for m in meshes) == n  # one handshake per ring edge


@pytest.mark.parametrize("origins", [[5], list(range(32))], ids=["one", "every"])
async def test_a_poisoned_group_reaches_every_member_over_a_few_links_each(origins) -> None:
    n = 32
    async with tcp_world(n, timeout=60) as meshes:
        waiting = [m.irecv((m.rank + 1) % n, tag=Tag(7, 1)) for m in meshes]
        for r in origins:
            error = CollectiveTimeout(f"all_reduce #1 timed out on rank {r}")
            meshes[r].poison_group(7, error, range(n))
        async with asyncio.timeout(30):
            for receive in waiting:
                with pytest.raises(CollectiveTimeout, match="timed out on rank"):
                    await receive.wait()
        # up a binomial tree to rank 0 and down it: at most log2(n) links each way
        assert max(len(m.peers()) for m in meshes) <= 2 * (n - 1).bit_length()
        assert sum(m.links.dials for m in meshes) <= 2 * (n - 1)
