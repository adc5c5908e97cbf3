"""What a newcomer meets first: a script run without a launcher, and listeners on ports a
firewall admits."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from shardwire.worker.runtime.launched import LAUNCHER_VARIABLES
from tests.worker.transport.fabric import free_port_range

from .cli import ROOT, SCRIPTS, background, env, shardwire

pytestmark = pytest.mark.e2e


def test_a_script_run_without_a_launcher_says_how_to_launch_it_at_once() -> None:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "examples/hello.py"],
        check=False,
        env={k: v for k, v in env().items() if k not in LAUNCHER_VARIABLES},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    took = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert "no launcher started this process" in result.stderr
    assert "shardwire launch --standalone --nproc-per-node 2 hello.py" in result.stderr
    assert "Traceback" not in result.stderr
    # No wait at all: the time is the interpreter's start (long on a loaded machine)
    assert took < 60, took


def test_peer_listeners_take_the_ports_of_the_range() -> None:
    low, _ = free_port_range(3)
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--peer-port-range",
        f"{low}-{low + 2}",
        str(SCRIPTS / "listening.py"),
    )
    assert result.returncode == 0, result.stderr
    ports = {
        int(m.group(1)): int(m.group(2))
        for m in re.finditer(r"rank \d+ local (\d+) listens on (\d+)", result.stdout)
    }
    assert ports == {0: low, 1: low + 1, 2: low + 2}, result.stdout


def test_the_range_is_read_from_the_environment_too() -> None:
    low, _ = free_port_range(2)
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "listening.py"),
        SHARDWIRE_PEER_PORT_RANGE=f"{low}-{low + 1}",
    )
    assert result.returncode == 0, result.stderr
    found = sorted(int(p) for p in re.findall(r"listens on (\d+)", result.stdout))
    assert found == [low, low + 1], result.stdout


def test_a_range_smaller_than_the_node_is_refused_before_anything_starts() -> None:
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--peer-port-range",
        "29500-29501",
        str(SCRIPTS / "listening.py"),
    )
    assert result.returncode == 2, result.stderr
    assert "--peer-port-range 29500-29501 holds 2 port(s) for 3 ranks" in result.stderr
    assert "listening on" not in result.stderr  # no coordinator was started


def test_a_malformed_range_is_refused_naming_the_flag() -> None:
    result = shardwire(
        "launch", "--standalone", "--peer-port-range", "29600-29500", str(SCRIPTS / "listening.py")
    )
    assert result.returncode == 2
    assert "--peer-port-range must run from a lower to a higher port" in result.stderr


def test_a_standalone_job_says_how_to_watch_it_and_status_finds_it(tmp_path) -> None:
    cards = {"XDG_RUNTIME_DIR": str(tmp_path)}
    job = background(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--run-id",
        "watched",
        str(SCRIPTS / "wait.py"),
        **cards,
    )
    try:
        assert job.stdout is not None and job.stderr is not None
        ready = sum("ready" in job.stdout.readline() for _ in range(2))
        assert ready == 2
        lines = []
        for _ in range(10):  # among the launcher's first lines, before the ranks start
            lines.append(job.stderr.readline())
            if "shardwire status" in lines[-1]:
                break
        token_file = tmp_path / "shardwire" / "watched.token"
        assert lines[-1] == (
            f"[launch]: shardwire status --run-id watched shows this job (token in {token_file})\n"
        ), lines
        assert token_file.stat().st_mode & 0o777 == 0o600
        # the command as printed, nothing else given: the card says where and how
        found = shardwire("status", "--run-id", "watched", timeout=30, **cards)
        assert found.returncode == 0, found.stderr
        assert "run 'watched': running, world size 2" in found.stdout
        # another run id has no card: the defaults are used, and nobody answers there
        other = shardwire("status", "--run-id", "other", "--timeout", "1", timeout=30, **cards)
        assert other.returncode == 1 and "127.0.0.1:29400" in other.stderr
    finally:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=60)
    assert not token_file.exists()  # the card goes with the job
    assert not (tmp_path / "shardwire" / "watched.json").exists()
