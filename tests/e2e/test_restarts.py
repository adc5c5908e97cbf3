"""Restarts end to end: digits on four workers with checkpoints every 20 steps; one
worker SIGKILLed mid-run. With ``--max-restarts`` the job resumes from its latest
checkpoint as generation 2 and ends exactly like an uninterrupted run; without, it fails
as before, and both summaries list the generations."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardwire.worker.transport import shm
from tests.docblocks import block

from .cli import ROOT, SHARDWIRE, env, run, run_records
from .pageruns import assert_shows

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = "160"
KILL_AT = "step 100/160"


def _command(tmp_path: Path, name: str, *flags: str) -> list[str]:
    return [
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        "4",
        *flags,
        "examples/digits.py",
        "--steps",
        STEPS,
        "--log-every",
        "20",
        "--save-every",
        "20",
        "--run-dir",
        str(tmp_path / name / "run"),
        "--checkpoint-dir",
        str(tmp_path / name / "ckpt"),
    ]


def _workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (read from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != launcher:
            continue
        ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
        if ranks:
            found[int(ranks[0])] = int(entry.name)
    return found


def _run_and_kill(tmp_path: Path, name: str, *flags: str) -> subprocess.CompletedProcess:
    """Run the job; SIGKILL rank 2 once rank 0 reports step 100."""
    job = subprocess.Popen(
        _command(tmp_path, name, *flags),
        cwd=ROOT,
        # started with python, not forked: /proc shows a forked rank the server's
        # environment, and rank 2 is found by its RANK there
        env=env(SHARDWIRE_FORK_RANKS="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out: list[str] = []
    try:
        assert job.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = job.stdout.readline()
            assert line, "the job ended before it could be killed"
            out.append(line)
            if KILL_AT in line:
                break
        os.kill(_workers(job.pid)[2], signal.SIGKILL)
        rest, err = job.communicate(timeout=400)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=60)
    return subprocess.CompletedProcess(job.args, job.returncode, "".join(out) + rest, err)


def _results(tmp_path: Path, name: str) -> tuple[dict, dict]:
    return run_records(tmp_path / name / "run")


def test_a_killed_worker_is_restarted_and_the_job_ends_like_an_uninterrupted_run(
    tmp_path,
) -> None:
    straight = run(_command(tmp_path, "straight"), cwd=ROOT, timeout=400)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "generation" not in straight.stderr  # one generation: no history printed
    restarted = _run_and_kill(tmp_path, "killed", "--recovery", "relaunch", "--max-restarts", "2")
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    err = restarted.stderr
    assert "starting generation 2 (restart 1 of 2)" in err
    # the elastic guide's sample; who notices the death first, and so its words, varies
    why = ((r"rank 2 failed: .*?(\); starting|$)", r"rank 2 failed: <why>\1"),)
    assert_shows(block("restart-output").output(), err, vary=why)
    report = err[err.index("shardwire: job finished after 2 generations (1 restarts)") :]
    assert "generation 1: 4 ranks on 1 node" in report
    assert "rank 2 failed" in report and "generation 2: 4 ranks on 1 node" in report
    assert "resuming" in restarted.stdout
    expected, summary = _results(tmp_path, "straight")
    got, resumed = _results(tmp_path, "killed")
    assert got == expected  # every logged loss, learning rate and accuracy, bit for bit
    for key in ("final_loss", "held_out_accuracy"):
        assert resumed[key] == summary[key]
    # the default run id: nothing left behind (a job beside it may have names of its own)
    assert not shm.left_behind("shardwire")


def test_without_restarts_the_same_kill_fails_the_job_with_the_generation(tmp_path) -> None:
    failed = _run_and_kill(tmp_path, "once", "--max-restarts", "0")
    assert failed.returncode != 0
    err = failed.stderr
    summary = err[err.index("shardwire: job failed") :]
    assert "root cause (from the coordinator): rank 2" in summary
    assert "killed by signal SIGKILL" in summary
    assert "generation 1: 4 ranks on 1 node" in summary and "rank 2 failed" in summary
    assert "starting generation 2" not in err
