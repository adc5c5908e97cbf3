"""The peer connections' TCP tuning: the chosen congestion control and unsent low-water
mark are on both ends of every connection, from the environment through to the socket;
settings the kernel cannot take are refused, typed, when the rank starts listening."""

from __future__ import annotations

import asyncio
import shlex

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument, Tag, Token
from shardwire.worker.api import mesh_config
from shardwire.worker.runtime.worker_config import WorkerConfig
from shardwire.worker.transport import MeshConfig, TcpMesh, tcptuning
from tests.docblocks import block

from .fabric import tcp_world

LOWAT = 196608  # not the kernel's default (no mark: 4294967295)


def _other_than_default() -> str:
    """An algorithm this kernel lets a connection use that is not its default (so the
    test tells the setting from the default)."""
    try:
        available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4: not Linux")
    for name in available:
        if name != tcptuning.system_default():
            try:
                tcptuning.check(name)
            except InvalidArgument:
                continue
            return name
    pytest.skip(f"this kernel offers no algorithm besides its default ({available})")


async def _ends(meshes: list[TcpMesh]) -> list[dict[str, object]]:
    """What both ends of rank 0's connection to rank 1 use, once a payload has crossed."""
    a, b = meshes
    x = np.arange(4.0)
    got, _ = await asyncio.gather(b.recv(0, tag=Tag(0, 0)), a.send(1, x, tag=Tag(0, 0)))
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    ends = [a.connection(1), b.connection(0)]
    assert all(c is not None and c.socket is not None for c in ends)
    return [tcptuning.used(c.socket) for c in ends]  # type: ignore[union-attr, arg-type]


async def test_the_chosen_settings_are_on_the_dialled_and_the_accepted_socket() -> None:
    name = _other_than_default()
    async with tcp_world(2, tcp_congestion=name, tcp_notsent_lowat=LOWAT) as meshes:
        used = await _ends(meshes)
    assert used == [{"congestion": name, "notsent_lowat": LOWAT}] * 2
    async with tcp_world(2, tcp_congestion=name) as meshes:  # each setting on its own
        assert [u["congestion"] for u in await _ends(meshes)] == [name, name]
    async with tcp_world(2, tcp_notsent_lowat=LOWAT) as meshes:
        used = await _ends(meshes)
    assert [u["notsent_lowat"] for u in used] == [LOWAT, LOWAT]
    assert [u["congestion"] for u in used] == [tcptuning.system_default()] * 2
    async with tcp_world(2) as meshes:  # unset: the kernel's defaults
        used = await _ends(meshes)
    assert [u["congestion"] for u in used] == [tcptuning.system_default()] * 2
    assert LOWAT not in [u["notsent_lowat"] for u in used]


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"tcp_congestion": "nosuchalgo"}, "no such algorithm"),
        ({"tcp_congestion": "Cubic!"}, "lowercase letters"),
        ({"tcp_notsent_lowat": 0}, "at least 1"),
    ],
)
async def test_an_unusable_setting_is_refused_when_the_rank_listens(setting, says) -> None:
    config = MeshConfig(run_id="test", token=Token("t"), **setting)
    mesh = TcpMesh(config, timeout=5)
    try:
        with pytest.raises(InvalidArgument, match=says) as caught:
            await mesh.listen()
        assert str(next(iter(setting.values()))) in str(caught.value)
        if says == "no such algorithm":
            assert "available:" in str(caught.value)
    finally:
        await mesh.aclose()


def test_the_settings_reach_the_mesh_from_the_environment() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    plain = mesh_config(WorkerConfig.from_env(env), run_id="r", token=Token(None))
    assert (plain.tcp_congestion, plain.tcp_notsent_lowat) == (None, None)
    tuned = {"SHARDWIRE_TCP_CONGESTION": "cubic", "SHARDWIRE_TCP_NOTSENT_LOWAT": "262144"}
    cfg = WorkerConfig.from_env({**env, **tuned})
    mesh = mesh_config(cfg, run_id="r", token=Token(None))
    assert (mesh.tcp_congestion, mesh.tcp_notsent_lowat) == ("cubic", 262144)
    with pytest.raises(ValueError, match="SHARDWIRE_TCP_CONGESTION"):
        WorkerConfig.from_env({**env, "SHARDWIRE_TCP_CONGESTION": "../cubic"})
    with pytest.raises(ValueError, match="SHARDWIRE_TCP_NOTSENT_LOWAT"):
        WorkerConfig.from_env({**env, "SHARDWIRE_TCP_NOTSENT_LOWAT": "0"})


async def test_the_slow_links_guides_settings_reach_both_ends_of_a_connection() -> None:
    (command,) = block("slow-link-tcp").commands()
    words = shlex.split(command)
    assert words[0] == "export"
    env = dict(word.split("=", 1) for word in words[1:])
    cfg = WorkerConfig.from_env({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", **env})
    mesh = mesh_config(cfg, run_id="test", token=Token("t"))
    settings = {"tcp_congestion": mesh.tcp_congestion, "tcp_notsent_lowat": mesh.tcp_notsent_lowat}
    try:
        tcptuning.check(mesh.tcp_congestion, mesh.tcp_notsent_lowat)
    except InvalidArgument as exc:
        pytest.skip(f"this kernel cannot take the guide's settings: {exc}")
    async with tcp_world(2, **settings) as meshes:
        used = await _ends(meshes)
    want = {"congestion": env["SHARDWIRE_TCP_CONGESTION"]}
    want["notsent_lowat"] = int(env["SHARDWIRE_TCP_NOTSENT_LOWAT"])
    assert used == [want, want]
