"""The peer listener's port: ephemeral by default, else the first free one of the range a
firewall admits (``--peer-port-range``), from the local rank's place in it on."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument, Tag
from shardwire.protocol.ports import port_range
from shardwire.worker.transport import ListenFailed, MeshConfig, TcpMesh

from .fabric import TOKEN, free_port_range, start_all


def _mesh(ports: tuple[int, int] | None) -> TcpMesh:
    return TcpMesh(MeshConfig(run_id="test", token=TOKEN, listen_ports=ports), timeout=10)


def _held(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


async def test_local_ranks_take_their_own_port_of_the_range_and_talk() -> None:
    low, high = free_port_range(3)
    meshes = [_mesh((low, high)) for _ in range(3)]
    try:
        ports = [await m.listen(first=r) for r, m in enumerate(meshes)]
        assert ports == [low, low + 1, low + 2]
        start_all(meshes, ports)
        payload = np.arange(8.0)
        got, _ = await asyncio.gather(
            meshes[0].recv(2, tag=Tag(0, 0)), meshes[2].send(0, payload, tag=Tag(0, 0))
        )
        np.testing.assert_array_equal(got, payload)
    finally:
        for m in meshes:
            await m.aclose()


async def test_a_port_in_use_is_skipped_and_the_search_wraps_around() -> None:
    low, high = free_port_range(3)
    with _held(low + 2), _held(low + 1):
        mesh = _mesh((low, high))
        try:
            assert await mesh.listen(first=1) == low  # low+1 and low+2 taken: wrapped
        finally:
            await mesh.aclose()


async def test_a_full_range_fails_naming_the_range() -> None:
    low, high = free_port_range(2)
    with _held(low), _held(high):
        mesh = _mesh((low, high))
        try:
            with pytest.raises(ListenFailed, match=f"in the peer port range {low}-{high}: all 2"):
                await mesh.listen()
        finally:
            await mesh.aclose()


def _ephemeral_range() -> tuple[int, int]:
    first, last = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(first), int(last)


async def test_without_a_range_the_port_is_ephemeral() -> None:
    first, last = _ephemeral_range()
    mesh = _mesh(None)
    try:
        port = await mesh.listen()
        assert first <= port <= last
    finally:
        await mesh.aclose()


@pytest.mark.parametrize(
    ("text", "expected"), [("29500-29563", (29500, 29563)), ("29500", (29500, 29500))]
)
def test_port_ranges_parse(text: str, expected: tuple[int, int]) -> None:
    assert port_range(text, "--peer-port-range") == expected


@pytest.mark.parametrize("text", ["29563-29500", "0-10", "29500-70000", "a-b", "29500-", ""])
def test_bad_port_ranges_are_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(InvalidArgument, match="--peer-port-range"):
        port_range(text, "--peer-port-range")
