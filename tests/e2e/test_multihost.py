"""Multi-host for real: a coordinator and two worker nodes in three Linux network
namespaces joined by a bridge, each "host" with its own private address, training the
digits example with the token. Skipped (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import json

import pytest

from .cli import SHARDWIRE, env
from .netns import SUBNET, inside

pytestmark = pytest.mark.e2e


def test_coordinator_and_two_worker_hosts_train_digits(hosts, tmp_path) -> None:
    coordinator_ns, node_a, node_b = hosts
    token = {"SHARDWIRE_TOKEN": "multi-host-token"}
    coordinator = inside(
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
                inside(
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
    proc = inside(
        hosts[0], SHARDWIRE, "coordinator", "--host", f"{SUBNET}.1", "--port", "29401", env=env()
    )
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "refusing to bind the coordinator to 10.77.0.1 without a token" in err
