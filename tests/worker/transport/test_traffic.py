"""Per-link traffic: every payload counted on the link and path it took, both ways;
large payloads timed; the kernel's round-trip time read; reports carry only the links
that moved, busiest first, within the heartbeat's bound."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from shardwire.protocol import Tag
from shardwire.protocol.linkreports import LINKS_PER_BEAT
from shardwire.protocol.messages import Heartbeat
from shardwire.worker.transport.shmlink import SHM_MIN_BYTES
from shardwire.worker.transport.traffic import TIMED_BYTES, Traffic, kernel_rtt_us

from .fabric import shm_world, tcp_world


async def _send_all(meshes, sizes: dict[tuple[int, int], int], seq: int = 0) -> None:
    """Each (src, dst) sends one payload of its size."""
    sends = [
        meshes[s].send(d, np.ones(n, dtype=np.uint8), tag=Tag(3, seq))
        for (s, d), n in sizes.items()
    ]
    recvs = [meshes[d].recv(s, tag=Tag(3, seq)) for (s, d) in sizes]
    await asyncio.gather(*sends, *recvs)


async def test_each_link_counts_its_own_bytes_and_messages_both_ways() -> None:
    sizes = {(0, 1): 1000, (1, 0): 3000, (0, 2): 50, (2, 1): 7}
    async with tcp_world(3) as meshes:
        for seq in range(2):
            await _send_all(meshes, sizes, seq)
        for (src, dst), n in sizes.items():
            out, into = meshes[src].traffic.get(dst), meshes[dst].traffic.get(src)
            assert out is not None and into is not None
            assert (out.bytes_sent, out.messages_sent) == (2 * n, 2), (src, dst)
            assert (into.bytes_received, into.messages_received) == (2 * n, 2), (src, dst)
        for rank, peer in ((1, 2), (2, 0)):  # links used one way only: nothing sent back
            back = meshes[rank].traffic.get(peer)
            assert back is not None and (back.bytes_sent, back.messages_sent) == (0, 0)


async def test_large_payloads_are_timed_and_the_round_trip_is_read() -> None:
    async with tcp_world(2) as meshes:
        await _send_all(meshes, {(0, 1): TIMED_BYTES - 1})
        small = meshes[1].traffic.get(0)
        assert small is not None and small.timed_bytes == 0  # one read: not a bandwidth
        await _send_all(meshes, {(0, 1): 4 * TIMED_BYTES}, seq=1)
        timed = meshes[1].traffic.get(0)
        assert timed is not None and timed.timed_bytes == 4 * TIMED_BYTES
        assert timed.timed_us > 0
        sender = meshes[0].traffic.get(1)
        assert sender is not None and 0 < sender.rtt_us < 1_000_000  # loopback: well below 1 s


async def test_payloads_through_shared_memory_count_on_the_shm_path() -> None:
    async with shm_world(2) as meshes:
        await _send_all(meshes, {(0, 1): SHM_MIN_BYTES, (1, 0): 10})
        await _send_all(meshes, {(0, 1): SHM_MIN_BYTES}, seq=1)
        shm_out = meshes[0].traffic.get(1, "shm")
        shm_in = meshes[1].traffic.get(0, "shm")
        assert shm_out is not None and shm_in is not None
        # the first large payload may go on TCP while the segment is offered; later ones
        # take the segment, and both ends agree on what took which path
        assert shm_out.bytes_sent == shm_in.bytes_received >= SHM_MIN_BYTES
        tcp_in = meshes[1].traffic.get(0, "tcp")
        total = shm_in.bytes_received + (tcp_in.bytes_received if tcp_in else 0)
        assert total == 2 * SHM_MIN_BYTES
        assert meshes[0].traffic.get(1, "tcp").bytes_received == 10


def test_reports_carry_the_links_that_moved_busiest_first_and_stay_bounded() -> None:
    traffic = Traffic()
    for peer in range(LINKS_PER_BEAT + 10):
        traffic.sent(peer, "tcp", 100 + peer)
    first = traffic.report()
    assert len(first) == LINKS_PER_BEAT
    assert [r.peer for r in first[:3]] == [
        LINKS_PER_BEAT + 9,
        LINKS_PER_BEAT + 8,
        LINKS_PER_BEAT + 7,
    ]
    rest = traffic.report()
    assert sorted(r.peer for r in rest) == list(range(10))  # the ones left over, then none
    assert traffic.report() == []
    traffic.received(3, "shm", 5)
    again = traffic.report()
    assert [(r.peer, r.path, r.bytes_received, r.messages_received) for r in again] == [
        (3, "shm", 5, 1)
    ]
    traffic.round_trip(3, 250)
    assert [(r.peer, r.path, r.rtt_us, r.bytes_sent) for r in traffic.report()] == [
        (3, "tcp", 250, 103)
    ]
    traffic.round_trip(3, 250)  # unchanged: nothing to report
    assert traffic.report() == []
    # a full report fits a heartbeat
    Heartbeat(links=first)


def test_small_payloads_are_never_timed() -> None:
    traffic = Traffic()
    traffic.received(1, "tcp", TIMED_BYTES - 1, seconds=0.5)
    traffic.received(1, "tcp", TIMED_BYTES, seconds=0.25)
    link = traffic.get(1)
    assert link is not None and (link.timed_bytes, link.timed_us) == (TIMED_BYTES, 250_000)
    assert link.peak_bps == TIMED_BYTES * 4


def test_the_peak_rate_is_the_fastest_timed_payloads() -> None:
    traffic = Traffic()
    for seconds in (0.5, 0.001, 0.25):  # one payload read at once, two read late
        traffic.received(1, "tcp", TIMED_BYTES, seconds=seconds)
    link = traffic.get(1)
    assert link is not None and link.peak_bps == TIMED_BYTES * 1000
    assert link.timed_bytes / (link.timed_us / 1e6) < TIMED_BYTES * 5  # the average: slow
    (report,) = traffic.report()
    assert report.peak_bps == TIMED_BYTES * 1000


def test_the_kernel_round_trip_of_a_connected_socket() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=10)
        peer, _ = server.accept()
        with client, peer:
            client.sendall(b"x" * 1000)
            assert peer.recv(1000)
            peer.sendall(b"y")
            assert client.recv(1) == b"y"
            if not hasattr(socket, "TCP_INFO"):
                pytest.skip("this platform does not report TCP_INFO")
            assert 0 < kernel_rtt_us(client) < 1_000_000
    assert kernel_rtt_us(None) == 0
