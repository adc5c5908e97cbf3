"""The shardwire command end to end: real processes over loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.procs import descendants, running

from .cli import (
    ROOT,
    SCRIPTS,
    SHARDWIRE,
    Lines,
    background,
    env,
    shardwire,
    start_coordinator,
)

pytestmark = pytest.mark.e2e


def test_standalone_hello_on_four_workers() -> None:
    result = shardwire("launch", "--standalone", "--nproc-per-node", "4", "examples/hello.py")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "received" in line)
    assert len(lines) == 4
    for rank, line in enumerate(lines):
        left = (rank - 1) % 4
        assert line.startswith(f"[rank{rank}]: rank {rank}/4 (node 0, local {rank})")
        assert line.endswith(f"received [{left}.0, {left}.0, {left}.0, {left}.0] from rank {left}")


def test_flags_can_come_from_the_environment() -> None:
    result = shardwire(
        "launch", "examples/hello.py", SHARDWIRE_STANDALONE="1", SHARDWIRE_NPROC_PER_NODE="2"
    )
    assert result.returncode == 0, result.stderr
    assert len([x for x in result.stdout.splitlines() if "received" in x]) == 2


def test_killed_child_fails_the_launch_with_a_summary() -> None:
    start = time.monotonic()
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        str(SCRIPTS / "fail.py"),
        FAIL_RANK="1",
        FAIL_MODE="kill",
    )
    assert time.monotonic() - start < 30
    assert result.returncode != 0
    summary = result.stderr[result.stderr.index("shardwire: job failed") :]
    assert "root cause (from the coordinator): rank 1" in summary
    assert re.search(r"first failure on this node: rank 1 .* killed by signal SIGKILL", summary)
    assert "Traceback" not in result.stderr  # nobody raised: no traceback anywhere


def test_raising_child_shows_its_exception_on_the_launcher() -> None:
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        str(SCRIPTS / "fail.py"),
        FAIL_RANK="2",
        FAIL_MODE="raise",
    )
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("shardwire: job failed") :]
    assert "rank 2: raised RuntimeError: deliberate failure on rank 2" in summary
    assert "RuntimeError: deliberate failure on rank 2" in summary.split("last lines")[1]
    # survivors stop with one line naming the failed rank, not a wall of tracebacks
    assert "[rank0]: shardwire: stopped: rank 2 failed" in result.stderr
    others = [x for x in result.stderr.splitlines() if not x.startswith("[rank2]")]
    assert not any("Traceback" in x for x in others), result.stderr


def test_two_nodes_through_a_separate_coordinator() -> None:
    token = {"SHARDWIRE_TOKEN": "e2e-token"}
    coordinator, port = start_coordinator("--world-size", "4", "--run-id", "e2e", **token)
    try:
        nodes = [
            subprocess.Popen(
                [
                    SHARDWIRE,
                    "worker",
                    "--coordinator",
                    f"127.0.0.1:{port}",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--node-id",
                    node,
                    "--run-id",
                    "e2e",
                    "examples/hello.py",
                ],
                env=env(**token),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for node in ("node-b", "node-a")
        ]
        outputs = [n.communicate(timeout=60) for n in nodes]
        assert [n.returncode for n in nodes] == [0, 0], outputs
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (coordinator, *locals().get("nodes", [])):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    node_b, node_a = (out for out, _err in outputs)
    assert "[rank0]: rank 0/4 (node 0, local 0)" in node_a
    assert "[rank3]: rank 3/4 (node 1, local 1) received [2.0, 2.0, 2.0, 2.0]" in node_b


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_forwarded_cleanly_and_nothing_is_left_behind(sig) -> None:
    proc = background("launch", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "wait.py"))
    try:
        Lines(proc.stdout).until("ready", count=2, timeout=60)
        started = descendants(proc.pid)  # the fork server and the ranks it forked
        assert len(started) >= 2, started
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 128 + sig
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert f"shardwire: job stopped by {sig.name}" in err
        assert "Traceback" not in err and "Error" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [pid for pid in started if running(pid)] == []


def test_wrong_token_between_node_and_coordinator_is_reported() -> None:
    coordinator, port = start_coordinator(
        "--world-size", "1", "--join-timeout", "20", SHARDWIRE_TOKEN="right"
    )
    try:
        result = shardwire(
            "worker",
            "--coordinator",
            f"127.0.0.1:{port}",
            "examples/hello.py",
            SHARDWIRE_TOKEN="wrong",
            timeout=30,
        )
        assert result.returncode == 1
        assert "token" in result.stderr and "right" not in result.stderr
    finally:
        coordinator.kill()
        coordinator.wait()


def test_status_command_against_a_running_job() -> None:
    token = {"SHARDWIRE_TOKEN": "status-token"}
    coordinator, port = start_coordinator("--world-size", "2", **token)
    node = background(
        "worker",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "wait.py"),
        **token,
    )
    try:
        Lines(node.stdout, beside=Lines(node.stderr)).until("ready", count=2, timeout=60)
        result = shardwire("status", "--coordinator", f"127.0.0.1:{port}", timeout=30, **token)
        assert result.returncode == 0, result.stderr
        assert "run 'shardwire': running, world size 2" in result.stdout
        assert len([line for line in result.stdout.splitlines() if " running " in line]) == 2
        wrong = shardwire(
            "status", "--coordinator", f"127.0.0.1:{port}", timeout=30, SHARDWIRE_TOKEN="nope"
        )
        assert wrong.returncode == 1 and "token" in wrong.stderr
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=30)
        coordinator.wait(timeout=30)


def test_health_command_checks_the_coordinator() -> None:
    coordinator, _port = start_coordinator("--world-size", "1", "--http-port", "0")
    try:
        assert coordinator.stderr is not None
        line = coordinator.stderr.readline()
        assert line.startswith("status page on http://"), line
        url = line.strip().rsplit(" ", 1)[1]
        assert shardwire("health", "--url", f"{url}healthz").returncode == 0
    finally:
        coordinator.kill()
        coordinator.wait()
    down = shardwire("health", "--url", f"{url}healthz", "--timeout", "2")
    assert down.returncode == 1 and "healthz" in down.stderr


def _wait_for_line(proc: subprocess.Popen, start: str, timeout: float = 60) -> None:
    """Read the process's stdout until a line starts with ``start`` (bounded)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"output ended before {start!r}"
        if line.startswith(start):
            return
    raise AssertionError(f"no {start!r} within {timeout:g} s")


def _child_pid(launcher: int, rank: int) -> int:
    """The launcher's worker process with ``RANK=rank`` (from /proc)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no child with RANK={rank} among {children}")


def test_a_stopped_child_is_named_and_the_launcher_ends() -> None:
    proc = background(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--heartbeat-timeout",
        "1.5",
        "--term-timeout",
        "2",
        str(SCRIPTS / "steps.py"),
        STEPS="100000",
        STEP_DELAY="0.01",
        # started with python, not forked: /proc shows a forked rank the server's
        # environment, and this test finds rank 1 by its RANK there
        SHARDWIRE_FORK_RANKS="0",
    )
    try:
        _wait_for_line(proc, "[rank1]: step 5")
        os.kill(_child_pid(proc.pid, 1), signal.SIGSTOP)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    summary = err[err.index("shardwire: job failed") :]
    # --heartbeat-timeout reached the standalone coordinator: silent for 1.5 s, not 5
    assert re.search(
        r"root cause \(from the coordinator\): rank 1: no heartbeat for 1\.\d s", summary
    )
    assert re.search(r"first failure on this node: rank 1 .*: unresponsive", summary), summary


def _coordinator_address(proc: subprocess.Popen) -> str:
    """HOST:PORT from the launcher's "[coordinator]: listening on" line (bounded)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, "the launcher ended early"
        if line.startswith("[coordinator]: listening on "):
            return line.strip().rsplit(" ", 1)[1]
    raise AssertionError("the launcher did not print the coordinator's address")


def test_standalone_jobs_get_a_fresh_token_that_no_command_line_shows() -> None:
    proc = background("launch", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "wait.py"))
    try:
        assert proc.stdout is not None
        address = _coordinator_address(proc)
        ready = sum("ready" in proc.stdout.readline() for _ in range(2))
        assert ready == 2
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        tokens = set()
        for pid in children:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            tokens |= {e for e in environ if e.startswith(b"SHARDWIRE_TOKEN=")}
        assert len(tokens) == 1  # the coordinator and both workers share one token
        (token,) = tokens
        secret = token.split(b"=", 1)[1]
        assert len(secret) >= 32
        for pid in [proc.pid, *children]:
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        refused = shardwire("status", "--coordinator", address, timeout=30)
        assert refused.returncode == 1 and "token" in refused.stderr
        allowed = shardwire(
            "status", "--coordinator", address, timeout=30, SHARDWIRE_TOKEN=secret.decode()
        )
        assert allowed.returncode == 0 and "running" in allowed.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_when_the_coordinator_dies_every_rank_and_the_launcher_say_so() -> None:
    token = {"SHARDWIRE_TOKEN": "lost-token"}
    coordinator, port = start_coordinator("--world-size", "4", **token)
    node = background(
        "worker",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--nproc-per-node",
        "4",
        str(SCRIPTS / "steps.py"),
        STEPS="100000",
        STEP_DELAY="0.01",
        **token,
    )
    try:
        _wait_for_line(node, "[rank3]: step 5")
        coordinator.kill()
        _out, err = node.communicate(timeout=60)
    finally:
        for proc in (coordinator, node):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    lost = f"lost the coordinator at 127.0.0.1:{port}"
    for rank in range(4):
        assert f"[rank{rank}]: shardwire: stopped: {lost}" in err, err
    assert f"root cause: {lost}" in err
    assert "Traceback" not in err


def test_tls_flags_put_the_whole_job_on_tls(certificates) -> None:
    tls = certificates.member
    token = {"SHARDWIRE_TOKEN": "tls-token"}
    proc = background(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--tls-cert",
        tls.cert,
        "--tls-key",
        tls.key,
        "--tls-ca",
        tls.ca,
        str(SCRIPTS / "wait.py"),
        **token,
    )
    try:
        assert proc.stdout is not None
        address = _coordinator_address(proc)
        assert sum("ready" in proc.stdout.readline() for _ in range(2)) == 2  # peers met
        plain = shardwire("status", "--coordinator", address, "--timeout", "5", **token)
        assert plain.returncode == 1  # a client without TLS gets nowhere, and is told why
        assert "if it uses TLS" in plain.stderr and "Traceback" not in plain.stderr
        stranger = shardwire(
            "status",
            "--coordinator",
            address,
            "--timeout",
            "5",
            **token,
            **certificates.stranger.env(),
        )
        assert stranger.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in stranger.stderr
        member = shardwire("status", "--coordinator", address, **token, **tls.env())
        assert member.returncode == 0 and "running" in member.stdout, member.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
