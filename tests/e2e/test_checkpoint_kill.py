"""SIGKILL a job at random moments while it saves a checkpoint after every step: each
time, ``shardwire checkpoint verify`` passes on the latest checkpoint, and the job,
started again with the same command after every kill, ends with exactly the parameters
of an uninterrupted run."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import pytest

from shardwire.worker.launcher.cli import main as shardwire_main

from .cli import ROOT, SCRIPTS, SHARDWIRE, env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KILLS = 30
STEPS = "600"  # more than 30 short attempts get through


def _command() -> list[str]:
    return [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "saver.py")]


def _finish(ckpt) -> str:
    done = subprocess.run(
        _command(),
        check=False,
        cwd=ROOT,
        env=env(STEPS=STEPS, CKPT=str(ckpt)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    digests = set(re.findall(r"final (\w+)", done.stdout))
    assert len(digests) == 1, done.stdout[-2000:]
    return digests.pop()


def _kill_once(ckpt, delay: float) -> bool:
    """Start the job, let it save at least once, SIGKILL it after ``delay`` seconds.
    Returns False when the job finished before it could be killed."""
    job = subprocess.Popen(
        _command(),
        cwd=ROOT,
        env=env(STEPS=STEPS, CKPT=str(ckpt)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: launcher, coordinator, workers
    )
    try:
        assert job.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = job.stdout.readline()
            if not line or "final " in line:
                return False
            if "saved " in line:
                break
        time.sleep(delay)
        return True
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)


@pytest.mark.long(70)
@pytest.mark.timeout(900)  # 30 job starts: minutes on a loaded machine
def test_kill_during_saves_leaves_a_verified_checkpoint_and_resumes_exactly(
    tmp_path, capsys
) -> None:
    expected = _finish(tmp_path / "straight")
    moments = random.Random(12345)
    ckpt = tmp_path / "killed"
    for kill in range(KILLS):
        assert _kill_once(ckpt, moments.uniform(0.0, 0.1)), "the job finished before 30 kills"
        if kill < KILLS - 1:  # the command's own entry point, without an interpreter's start
            assert shardwire_main(["checkpoint", "verify", str(ckpt)]) == 0, capsys.readouterr().err
            continue
        verified = subprocess.run(
            [SHARDWIRE, "checkpoint", "verify", str(ckpt)],
            check=False,
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verified.returncode == 0, verified.stderr
    assert _finish(ckpt) == expected
