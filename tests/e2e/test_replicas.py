"""Coordinator replicas over a real etcd, through real processes: the leader SIGKILLed
while digits trains, or cut off from etcd by a firewall while its workers still reach
it; a standby leads, the node agent and its ranks follow, and the job ends exactly as an
uninterrupted run. A replica's lease follows ``--etcd-ttl``; an etcd that does not
answer is named."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardwire.coordinator.etcd import EtcdClient
from tests.etcdserver import etcd_server, free_ports

from .cli import ROOT, SHARDWIRE, env
from .journaled import (
    TOKEN,
    node_agent,
    same_as_straight,
    stop,
    straight_run,
    token_file,
    until_step,
)
from .netns import SUBNET
from .pageruns import page_argv

pytestmark = pytest.mark.e2e
Replicas = dict[int, tuple[subprocess.Popen, Path]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[list, dict]:
    return straight_run(tmp_path_factory.mktemp("straight"))


def _replica(
    tmp_path: Path, etcd: str, port: int, *extra: str, netns: str = "", host: str = "127.0.0.1"
) -> tuple[subprocess.Popen, Path]:
    """One replica as the failures page starts it (the test's world size, token file,
    address and etcd in the place of the page's)."""
    given = {
        "--world-size": "2",
        "--token-file": str(token_file(tmp_path)),
        "--host": host,
        "--port": str(port),
        "--etcd": etcd,
    }
    argv = page_argv("coordinator-etcd", given)
    log = tmp_path / f"replica-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                *(["ip", "netns", "exec", netns] if netns else []),
                *argv,
                "--run-id",
                "restart",
                "--http-port",
                "-1",
                *extra,
            ],
            cwd=ROOT,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=out,
            text=True,
        )
    return proc, log


def _page_dials_every_replica() -> None:
    """The page's worker command names every replica's address, as the agent here."""
    argv = page_argv("coordinator-etcd", {}, which=1)
    assert argv[1] == "worker"
    assert len(argv[argv.index("--coordinator") + 1].split(",")) == 3


def _leader(replicas: Replicas, among: list[int]) -> int:
    """The port of the replica among ``among`` that says it leads (bounded wait)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for port in among:
            if "shardwire coordinator: leading run " in replicas[port][1].read_text():
                return port
        time.sleep(0.02)
    raise AssertionError("no replica led within 60 s")


def _ended(replicas: Replicas, agent: subprocess.Popen) -> tuple[dict[int, int], dict, str]:
    """The agent's end (it must finish), each replica's exit status, their logs."""
    _out, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err[-3000:]
    codes = {port: proc.wait(timeout=60) for port, (proc, _) in replicas.items()}
    return codes, {port: log.read_text() for port, (_, log) in replicas.items()}, err


def test_three_replicas_over_etcd_a_killed_leader_is_replaced_and_no_step_is_lost(
    tmp_path, straight
) -> None:
    """The leader is SIGKILLed while digits trains: a standby leads within a few
    seconds, the node agent and its ranks follow it."""
    ports = free_ports(3)
    first = ports[0]  # it leads: the address every process dials first is the one lost
    with etcd_server(tmp_path / "etcd") as etcd:
        replicas = {first: _replica(tmp_path, etcd, first)}
        agent = None
        try:
            assert _leader(replicas, [first]) == first
            replicas |= {port: _replica(tmp_path, etcd, port) for port in ports[1:]}
            _page_dials_every_replica()
            agent = node_agent(",".join(f"127.0.0.1:{p}" for p in ports), tmp_path / "ha")
            until_step(agent, 300)
            os.kill(replicas[first][0].pid, signal.SIGKILL)
            killed = time.monotonic()
            second = _leader(replicas, ports[1:])
            took = time.monotonic() - killed
            codes, logs, err = _ended(replicas, agent)
        finally:
            stop(*([agent] if agent else []), *(proc for proc, _ in replicas.values()))
    assert codes[first] == -signal.SIGKILL and codes[second] == 0, logs
    (third,) = set(ports) - {first, second}
    assert codes[third] == 0 and "run 'restart' finished under another replica" in logs[third]
    assert f"standby: 127.0.0.1:{first}" in logs[second]  # it waited, then led
    assert took < 15, took  # the lease (2 s) lapses, a standby leads: figures in the docs
    assert f"reconnected to the coordinator at 127.0.0.1:{second}" in err
    same_as_straight(tmp_path / "ha", straight)


def _cut_off(ns: str, host: str, port: int) -> None:
    """Drop every packet from ``ns`` to ``host:port`` (etcd), as a partition does."""
    rules = f"""
table inet shardwire_test {{
  chain output {{
    type filter hook output priority 0; policy accept;
    ip daddr {host} tcp dport {port} drop
  }}
}}
"""
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
        timeout=10,
    )


def test_a_leader_cut_off_from_etcd_steps_down_and_a_standby_leads(
    hosts, tmp_path, straight
) -> None:
    """Three hosts: etcd, a standby and the node agent on the first, the leader on the
    second, a standby on the third. A firewall on the leader's host drops its packets
    to etcd, while the agent still reaches it: the leader steps down before its lease
    can lapse (deposed, status 3), a standby leads with a newer epoch, and the job goes
    on with it."""
    if shutil.which("nft") is None:
        pytest.skip("nftables' nft is not installed")
    here, there, third = hosts
    addresses = {29400: (there, f"{SUBNET}.2"), 29401: (here, f"{SUBNET}.1")}
    addresses[29402] = (third, f"{SUBNET}.3")
    with etcd_server(tmp_path / "etcd", netns=here, host=f"{SUBNET}.1") as etcd:
        replicas = {29400: _replica(tmp_path, etcd, 29400, netns=there, host=f"{SUBNET}.2")}
        agent = None
        try:
            assert _leader(replicas, [29400]) == 29400
            for port in (29401, 29402):
                ns, host = addresses[port]
                replicas[port] = _replica(tmp_path, etcd, port, netns=ns, host=host)
            listed = ",".join(f"{host}:{port}" for port, (_, host) in addresses.items())
            agent = node_agent(listed, tmp_path / "ha", here)
            until_step(agent, 300)
            _cut_off(there, f"{SUBNET}.1", 2379)
            cut = time.monotonic()
            assert replicas[29400][0].wait(timeout=60) == 3  # it stepped down by itself
            stepped_down = time.monotonic() - cut
            second = _leader(replicas, [29401, 29402])
            codes, logs, err = _ended(replicas, agent)
        finally:
            stop(*([agent] if agent else []), *(proc for proc, _ in replicas.values()))
    assert "shardwire coordinator: deposed: its etcd lease could not be renewed" in logs[29400]
    assert stepped_down < 30, stepped_down
    epochs = [int(log.split("(epoch ")[1].split(")")[0]) for log in (logs[29400], logs[second])]
    assert epochs[1] > epochs[0], epochs
    assert codes[second] == 0, logs
    assert f"reconnected to the coordinator at {addresses[second][1]}:{second}" in err
    same_as_straight(tmp_path / "ha", straight)


def test_a_replica_leases_for_its_etcd_ttl_and_an_etcd_that_does_not_answer_is_named(
    tmp_path,
) -> None:
    (port, dead) = free_ports(2)
    with etcd_server(tmp_path / "etcd") as etcd:
        replica, log = _replica(tmp_path, etcd, port, "--etcd-ttl", "7")
        try:
            assert _leader({port: (replica, log)}, [port]) == port
            client = EtcdClient([etcd])
            key = client.get("/shardwire/restart/leader")
            assert key is not None and key.value.decode().startswith(f"127.0.0.1:{port} (PID ")
            lease = client.call("/v3/lease/timetolive", {"ID": str(key.lease)})
            assert int(lease["grantedTTL"]) == 7
        finally:
            stop(replica)
    unanswered = subprocess.run(
        [
            SHARDWIRE,
            "coordinator",
            "--port",
            str(port),
            "--etcd",
            f"127.0.0.1:{dead}",
            "--http-port",
            "-1",
        ],
        cwd=ROOT,
        env=env(**TOKEN),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert unanswered.returncode == 2, unanswered.stderr
    said = f"no etcd endpoint answered /v3/lease/grant (http://127.0.0.1:{dead}: "
    assert said in unanswered.stderr
