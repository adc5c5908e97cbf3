"""The peer connections' TCP congestion control: the chosen algorithm is on both ends of
every connection, from the environment through to the socket; names the kernel cannot
use are refused, typed, when the rank starts listening."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument, Tag, Token
from shardwire.worker.api import mesh_config
from shardwire.worker.runtime.worker_config import WorkerConfig
from shardwire.worker.transport import MeshConfig, TcpMesh, congestion

from .fabric import tcp_world


def _other_than_default() -> str:
    """An algorithm this kernel lets a connection use that is not its default (so the
    test tells the setting from the default)."""
    try:
        available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4: not Linux")
    for name in available:
        if name != congestion.system_default():
            try:
                congestion.check(name)
            except InvalidArgument:
                continue
            return name
    pytest.skip(f"this kernel offers no algorithm besides its default ({available})")


async def test_the_chosen_algorithm_is_on_the_dialled_and_the_accepted_socket() -> None:
    name = _other_than_default()
    async with tcp_world(2, tcp_congestion=name) as (a, b):
        got, _ = await asyncio.gather(
            b.recv(0, tag=Tag(0, 0)), a.send(1, np.arange(4.0), tag=Tag(0, 0))
        )
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
        ends = [a.connection(1), b.connection(0)]
        assert all(c is not None and c.socket is not None for c in ends)
        assert [congestion.used(c.socket) for c in ends] == [name, name]  # type: ignore[union-attr]
    async with tcp_world(2) as (a, b):  # unset: the kernel's default
        await asyncio.gather(b.recv(0, tag=Tag(0, 0)), a.send(1, np.arange(4.0), tag=Tag(0, 0)))
        conn = a.connection(1)
        assert conn is not None and conn.socket is not None
        assert congestion.used(conn.socket) == congestion.system_default()


@pytest.mark.parametrize(
    ("name", "says"),
    [("nosuchalgo", "no such algorithm"), ("Cubic!", "lowercase letters")],
)
async def test_an_unusable_algorithm_is_refused_when_the_rank_listens(name: str, says: str) -> None:
    mesh = TcpMesh(MeshConfig(run_id="test", token=Token("t"), tcp_congestion=name), timeout=5)
    try:
        with pytest.raises(InvalidArgument, match=says) as caught:
            await mesh.listen()
        assert name in str(caught.value)
        if says == "no such algorithm":
            assert "available:" in str(caught.value)
    finally:
        await mesh.aclose()


def test_the_setting_reaches_the_mesh_from_the_environment() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert WorkerConfig.from_env(env).tcp_congestion is None
    cfg = WorkerConfig.from_env({**env, "SHARDWIRE_TCP_CONGESTION": "cubic"})
    assert mesh_config(cfg, run_id="r", token=Token(None)).tcp_congestion == "cubic"
    with pytest.raises(ValueError, match="SHARDWIRE_TCP_CONGESTION"):
        WorkerConfig.from_env({**env, "SHARDWIRE_TCP_CONGESTION": "../cubic"})
