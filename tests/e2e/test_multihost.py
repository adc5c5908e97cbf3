"""Multi-host for real: a coordinator and two worker nodes in three Linux network
namespaces joined by a bridge, each "host" with its own private address, training the
digits example with the token. Skipped (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from .cli import ROOT, SHARDWIRE, env

pytestmark = pytest.mark.e2e

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 100000}"
    hub, names = f"swhub{tag}", [f"swh{i}x{tag}" for i in range(3)]
    try:
        _ip("netns", "add", hub)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    made = [hub]
    try:
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            _ip("netns", "add", name)
            made.append(name)
            inner, outer = f"sw{i}i{tag}"[:15], f"sw{i}o{tag}"[:15]
            _ip(
                "link",
                "add",
                inner,
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                outer,
                "netns",
                hub,
            )
            _ip("-n", hub, "link", "set", outer, "master", "br0")
            _ip("-n", hub, "link", "set", outer, "up")
            _ip("-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in made:
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=10
            )


def _in(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def test_coordinator_and_two_worker_hosts_train_digits(hosts, tmp_path) -> None:
    coordinator_ns, node_a, node_b = hosts
    token = {"SHARDWIRE_TOKEN": "multi-host-token"}
    coordinator = _in(
        coordinator_ns,
        SHARDWIRE,
        "coordinator",
        "--host",
        f"{SUBNET}.1",
        "--port",
        "29400",
        "--world-size",
        "4",
        "--run-id",
        "mh",
        env=env(**token),
    )
    nodes = []
    try:
        for ns, node in ((node_a, "node-a"), (node_b, "node-b")):
            nodes.append(
                _in(
                    ns,
                    SHARDWIRE,
                    "worker",
                    "--coordinator",
                    f"{SUBNET}.1:29400",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--node-id",
                    node,
                    "--run-id",
                    "mh",
                    "examples/digits.py",
                    "--steps",
                    "150",
                    "--run-dir",
                    str(tmp_path / node),
                    env=env(**token),
                )
            )
        outputs = [n.communicate(timeout=240) for n in nodes]
        assert [n.returncode for n in nodes] == [0, 0], [e[-2000:] for _, e in outputs]
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (coordinator, *nodes):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    summary = json.loads((tmp_path / "node-a" / "summary.json").read_text())
    assert summary["workers"] == 4
    assert summary["held_out_accuracy"] >= 0.95
    # every rank, including the two on the other host, moved bytes over the bridge
    assert len(summary["comm_MiB_per_rank"]) == 4 and min(summary["comm_MiB_per_rank"]) > 0


def test_coordinator_refuses_a_public_bind_without_a_token(hosts) -> None:
    proc = _in(
        hosts[0], SHARDWIRE, "coordinator", "--host", f"{SUBNET}.1", "--port", "29401", env=env()
    )
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "refusing to bind the coordinator to 10.77.0.1 without a token" in err
