"""Multi-host for real: a coordinator and two worker nodes in three Linux network
namespaces joined by a bridge, each "host" with its own private address, training the
digits example with the token. Skipped (with the reason) where namespaces cannot be made.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests.docblocks import block

from .cli import SHARDWIRE, env, run, run_records
from .netns import SUBNET, coordinator_inside, inside, worker_inside

pytestmark = pytest.mark.e2e


def _two_hosts(hosts, *script: str, node_ranks: tuple[int, int] = (0, 1)) -> str:
    """A coordinator host and two worker hosts of 2 ranks each running digits with
    ``script``'s arguments; returns the workers' output."""
    coordinator_ns, *nodes = hosts
    token = {"SHARDWIRE_TOKEN": "multi-host-token"}
    coordinator = coordinator_inside(
        coordinator_ns, f"{SUBNET}.1", 29400, world_size=4, run_id="mh", env=env(**token)
    )
    procs = [coordinator]
    try:
        for ns, node, index in zip(nodes, ("node-a", "node-b"), node_ranks, strict=True):
            procs.append(
                worker_inside(
                    ns,
                    f"{SUBNET}.1:29400",
                    "examples/digits.py",
                    *script,
                    nnodes=2,
                    nproc=2,
                    node_id=node,
                    node_rank=index,
                    run_id="mh",
                    env=env(**token),
                )
            )
        outputs = [p.communicate(timeout=240) for p in procs[1:]]
        assert [p.returncode for p in procs[1:]] == [0, 0], [e[-2000:] for _, e in outputs]
        assert coordinator.wait(timeout=30) == 0
        return "".join(out for out, _ in outputs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_coordinator_and_two_worker_hosts_train_digits(hosts, tmp_path) -> None:
    _two_hosts(hosts, "--steps", "150", "--run-dir", str(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 4
    assert summary["held_out_accuracy"] >= 0.95
    # every rank, including the two on the other host, moved bytes over the bridge
    assert len(summary["comm_MiB_per_rank"]) == 4 and min(summary["comm_MiB_per_rank"]) > 0


def _resumable(hosts, tmp_path, steps: int, node_ranks: tuple[int, int]) -> str:
    """digits saving to and resuming from one directory both hosts see (as a cluster's
    shared filesystem), logging into one run directory."""
    return _two_hosts(
        hosts,
        "--steps",
        str(steps),
        "--save-every",
        "50",
        "--log-every",
        "25",
        "--checkpoint-dir",
        str(tmp_path / "checkpoints" / "digits"),
        "--run-dir",
        str(tmp_path / "run"),
        node_ranks=node_ranks,
    )


def test_a_checkpoint_on_a_shared_directory_resumes_with_the_hosts_swapped(hosts, tmp_path) -> None:
    _resumable(hosts, tmp_path, 100, (0, 1))
    first, _ = run_records(tmp_path / "run")
    # node-a's ranks were 0 and 1; now node-b's are, and each rank reads shards the
    # other host wrote
    out = _resumable(hosts, tmp_path, 150, (1, 0))
    assert "step 125/150" in out and "step 25/150" not in out  # resumed at 100
    records, summary = run_records(tmp_path / "run")
    assert max(first) == 100 and max(records) == 150
    assert {s: records[s] for s in first} == first  # run 1's records, kept as they were
    assert summary["workers"] == 4 and summary["held_out_accuracy"] >= 0.9
    # the clusters page's check of it, run where the job ran
    (command,) = block("checkpoint-verify").commands()
    verify = run([SHARDWIRE, *shlex.split(command)[1:]], cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "digits" in command


def test_coordinator_refuses_a_public_bind_without_a_token(hosts) -> None:
    proc = inside(
        hosts[0], SHARDWIRE, "coordinator", "--host", f"{SUBNET}.1", "--port", "29401", env=env()
    )
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "refusing to bind the coordinator to 10.77.0.1 without a token" in err
