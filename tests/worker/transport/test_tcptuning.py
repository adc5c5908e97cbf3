"""The peer connections' TCP tuning: a connection to another host gets CUBIC and a
256 KiB unsent low-water mark, one on this machine the kernel's defaults, decided per
connection from its addresses; an explicit setting (``kernel`` and 0 for the kernel's)
is on both ends of every connection, from the environment through to the socket;
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
from shardwire.worker.transport.tcptuning import BETWEEN_HOSTS, KERNEL, TcpPlan, Tuning
from tests.docblocks import block

from .fabric import tcp_world

LOWAT = 196608  # not the kernel's default (no mark of the connection's own: 0)
KERNELS = Tuning()  # every setting left to the kernel
HERE = "10.1.2.3"  # this machine's address in the cases below
OWN = frozenset({HERE, "192.168.7.1", "fe80::1"})
AUTOMATIC = TcpPlan(None, None, BETWEEN_HOSTS, OWN)


@pytest.mark.parametrize(
    ("local", "remote"),
    [
        ("127.0.0.1", "127.0.0.1"),  # loopback
        ("127.0.0.1", "127.0.0.53"),  # the rest of 127/8
        ("::1", "::1"),  # loopback, IPv6
        ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),  # IPv4 loopback on a dual-stack socket
        (HERE, HERE),  # this machine's own address: the kernel routes it over loopback
        (HERE, "192.168.7.1"),  # another of this machine's addresses
        ("fe80::1%eth0", "fe80::1%eth0"),  # link-local, with its scope
        (HERE, "::ffff:192.168.7.1"),  # an own address, IPv4-mapped
        ("", "not-an-address"),  # unknown: the safe side
    ],
)
def test_a_connection_on_this_machine_keeps_the_kernels_defaults(local, remote) -> None:
    assert tcptuning.same_machine(local, remote, OWN)
    assert AUTOMATIC.for_connection(local, remote) == KERNELS


@pytest.mark.parametrize(
    ("local", "remote"),
    [
        (HERE, "10.1.2.4"),  # a neighbour on the same subnet
        (HERE, "203.0.113.9"),
        ("fd00::2", "fd00::3"),
        ("::ffff:10.1.2.3", "::ffff:10.1.2.4"),
    ],
)
def test_a_connection_to_another_host_gets_cubic_and_the_mark(local, remote) -> None:
    assert not tcptuning.same_machine(local, remote, OWN)
    assert AUTOMATIC.for_connection(local, remote) == Tuning("cubic", 262144)


@pytest.mark.parametrize(
    ("asked", "between", "here"),
    [
        ((None, None), Tuning("cubic", 262144), KERNELS),  # automatic
        (("bbr", None), Tuning("bbr", 262144), Tuning("bbr", None)),  # an override: everywhere
        ((None, LOWAT), Tuning("cubic", LOWAT), Tuning(None, LOWAT)),
        (("reno", LOWAT), Tuning("reno", LOWAT), Tuning("reno", LOWAT)),
        ((KERNEL, 0), KERNELS, KERNELS),  # the kernel's defaults, asked for
        ((KERNEL, None), Tuning(None, 262144), KERNELS),  # each spelling on its own
        ((None, 0), Tuning("cubic", None), KERNELS),
    ],
)
def test_an_explicit_setting_applies_to_every_connection(asked, between, here) -> None:
    chosen = TcpPlan(*asked, BETWEEN_HOSTS, OWN)
    assert chosen.for_connection(HERE, "10.1.2.4") == between
    assert chosen.for_connection("127.0.0.1", "127.0.0.1") == here


def test_without_cubic_the_automatic_choice_is_the_kernels_algorithm() -> None:
    unusable = Tuning("nosuchalgo", 262144)  # as CUBIC is where the kernel does not allow it
    assert not tcptuning.usable("nosuchalgo")
    chosen = tcptuning.plan(None, None, between_hosts=unusable)  # not refused: automatic
    assert chosen.for_connection(HERE, "10.1.2.4") == Tuning(None, 262144)
    with pytest.raises(InvalidArgument, match="no such algorithm"):
        tcptuning.plan("nosuchalgo", None)  # asked for: refused
    if tcptuning.usable("cubic"):
        assert tcptuning.plan(None, None).between_hosts == Tuning("cubic", 262144)


FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 192.0.2.0/24 2 0 2
           |-- 192.0.2.0
              /24 link UNICAST
           |-- 192.0.2.2
              /32 host LOCAL
        |-- 192.0.2.255
           /32 link BROADCAST
"""
IF_INET6 = """\
fd000000000000000000000000000002 04 40 00 82     eth0
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
"""


def test_this_machines_addresses_are_read_as_the_kernel_lists_them() -> None:
    listed = tcptuning.addresses_listed(FIB_TRIE, IF_INET6)
    assert listed == {"127.0.0.1", "192.0.2.2", "fd00::2", "fe80::fc:ff:fe00:1", "::1"}
    assert tcptuning.addresses_listed("", "") == frozenset()
    own = tcptuning.own_addresses()
    if own:  # Linux: this namespace's loopback address at least
        assert "127.0.0.1" in own


def _other_than_default() -> str:
    """An algorithm this kernel lets a connection use that is not its default (so the
    test tells the setting from the default)."""
    try:
        available = open("/proc/sys/net/ipv4/tcp_available_congestion_control").read().split()
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4: not Linux")
    for name in available:
        if name != tcptuning.system_default() and tcptuning.usable(name):
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


async def test_a_loopback_connection_keeps_the_kernels_defaults_unasked() -> None:
    async with tcp_world(2) as meshes:
        assert meshes[0].tcp.between_hosts.notsent_lowat == 262144  # would tune another host
        used = await _ends(meshes)
    assert used == [{"congestion": tcptuning.system_default(), "notsent_lowat": 0}] * 2


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
    async with tcp_world(2, tcp_congestion=KERNEL, tcp_notsent_lowat=0) as meshes:
        used = await _ends(meshes)
    assert used == [{"congestion": tcptuning.system_default(), "notsent_lowat": 0}] * 2


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"tcp_congestion": "nosuchalgo"}, "no such algorithm"),
        ({"tcp_congestion": "Cubic!"}, "lowercase letters"),
        ({"tcp_notsent_lowat": -1}, "0 for the kernel's default"),
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

    def asked(**settings: str) -> tuple[str | None, int | None]:
        mesh = mesh_config(
            WorkerConfig.from_env({**env, **settings}), run_id="r", token=Token(None)
        )
        return mesh.tcp_congestion, mesh.tcp_notsent_lowat

    assert asked() == (None, None)  # automatic
    tuned = {"SHARDWIRE_TCP_CONGESTION": "bbr", "SHARDWIRE_TCP_NOTSENT_LOWAT": "262144"}
    assert asked(**tuned) == ("bbr", 262144)
    kernels = {"SHARDWIRE_TCP_CONGESTION": "kernel", "SHARDWIRE_TCP_NOTSENT_LOWAT": "0"}
    assert asked(**kernels) == (KERNEL, 0)
    with pytest.raises(ValueError, match="SHARDWIRE_TCP_CONGESTION"):
        WorkerConfig.from_env({**env, "SHARDWIRE_TCP_CONGESTION": "../cubic"})
    with pytest.raises(ValueError, match="SHARDWIRE_TCP_NOTSENT_LOWAT"):
        WorkerConfig.from_env({**env, "SHARDWIRE_TCP_NOTSENT_LOWAT": "-1"})


async def test_the_slow_links_guides_setting_keeps_the_kernels_defaults_everywhere() -> None:
    (command,) = block("slow-link-tcp").commands()
    words = shlex.split(command)
    assert words[0] == "export"
    env = dict(word.split("=", 1) for word in words[1:])
    cfg = WorkerConfig.from_env({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", **env})
    mesh = mesh_config(cfg, run_id="test", token=Token("t"))
    settings = {"tcp_congestion": mesh.tcp_congestion, "tcp_notsent_lowat": mesh.tcp_notsent_lowat}
    chosen = tcptuning.plan(mesh.tcp_congestion, mesh.tcp_notsent_lowat)
    assert chosen.for_connection(HERE, "10.1.2.4") == KERNELS  # another host's too
    async with tcp_world(2, **settings) as meshes:
        used = await _ends(meshes)
    assert used == [{"congestion": tcptuning.system_default(), "notsent_lowat": 0}] * 2
