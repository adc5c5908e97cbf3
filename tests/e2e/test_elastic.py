"""An elastic job on two hosts (network namespaces) with ``--nnodes 1:2``: the second
node's agent is SIGKILLed mid-run and the job goes on with one node, resuming from the
shared checkpoint resharded to two ranks; the node then comes back and the next
generation has both nodes again. The job finishes on every node with status 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .cli import SHARDWIRE, env
from .netns import SUBNET, inside

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = {"SHARDWIRE_TOKEN": "elastic-token"}
RUN = "elastic"


def _node(ns: str, name: str, tmp_path: Path) -> subprocess.Popen:
    return inside(
        ns,
        SHARDWIRE,
        "worker",
        "--coordinator",
        f"{SUBNET}.1:29400",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--recovery",
        "relaunch",
        "--node-id",
        name,
        "--run-id",
        RUN,
        "examples/digits.py",
        "--steps",
        "600",
        "--log-every",
        "20",
        "--save-every",
        "10",
        "--run-dir",
        str(tmp_path / name),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        env=env(**TOKEN),
    )


def _wait_for(proc: subprocess.Popen, text: str, seen: list[str], *, timeout: float) -> None:
    """Read ``proc``'s stdout lines into ``seen`` until one contains ``text`` (bounded)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"ended before {text!r}: {''.join(seen[-20:])}"
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"no {text!r} within {timeout} s")


def _leftover_workers() -> list[int]:
    """PIDs of this test's worker processes still alive (environment names the run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"SHARDWIRE_RUN_ID={RUN}".encode() in environ:
                found.append(int(entry.name))
    return found


@pytest.mark.long(25)
def test_a_lost_node_shrinks_the_job_and_a_returning_node_grows_it(hosts, tmp_path) -> None:
    coordinator_ns, node_a, node_b = hosts
    coordinator = inside(
        coordinator_ns,
        SHARDWIRE,
        "coordinator",
        "--host",
        f"{SUBNET}.1",
        "--port",
        "29400",
        "--run-id",
        RUN,
        "--nnodes",
        "1:2",
        "--last-call",
        "2",
        "--http-port",
        "-1",
        env=env(**TOKEN),
    )
    a = _node(node_a, "node-a", tmp_path)
    b = _node(node_b, "node-b", tmp_path)
    again = None
    out_a: list[str] = []
    try:
        _wait_for(a, "step 60/600", out_a, timeout=240)
        os.kill(b.pid, signal.SIGKILL)  # node b's agent is gone for good
        b.wait(timeout=30)
        _wait_for(a, "resuming", out_a, timeout=120)  # generation 2: node a alone
        again = _node(node_b, "node-b", tmp_path)  # node b comes back
        rest_a, err_a = a.communicate(timeout=400)
        out_b, err_b = again.communicate(timeout=120)
        assert a.returncode == 0, err_a[-4000:]
        assert again.returncode == 0, err_b[-4000:]
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (coordinator, a, b, again):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in _leftover_workers():  # orphans of the killed agent, if any remained
            os.kill(pid, signal.SIGKILL)
    report = err_a[err_a.index("shardwire: job finished after 3 generations (1 restarts)") :]
    assert "generation 1: 4 ranks on 2 nodes" in report
    # the root cause is whichever news of node b reached the coordinator first: its
    # agent's connection closing, one of its ranks' (2 or 3) own connection closing, or
    # a rank of node a reporting one of node b's ranks gone; a busy machine orders them
    # any way, and every one of them names node b or its ranks, never node a's
    first = next(line for line in report.splitlines() if "generation 1:" in line)
    assert re.search(r"node 'node-b' lost|rank [23] failed: connection", first), first
    assert "generation 2: 2 ranks on 1 node" in report
    assert "membership change: node 'node-b' joined" in report
    assert "generation 3: 4 ranks on 2 nodes" in report and report.count("finished") >= 1
    summary = json.loads((tmp_path / "node-a" / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["steps"] == 600
    assert summary["held_out_accuracy"] >= 0.95
    assert "".join(out_a).count("resuming") >= 1 and "resuming" in rest_a
