"""A digits job of two ranks under one node agent, the same job run without a fault,
and the check that a run through faults logged exactly what that one did: the jobs the
coordinator-restart and coordinator-replica tests put through their faults."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .cli import ROOT, SHARDWIRE, env, run_records, shardwire

TOKEN = {"SHARDWIRE_TOKEN": "restart-token"}
STEPS = "1500"


def token_file(where: Path) -> Path:
    """The job's token in a file of mode 0600 in ``where`` (made once), for the
    coordinators started as the failures page starts them."""
    token = where / "token"
    if not token.exists():
        token.touch(0o600)
        token.write_text(TOKEN["SHARDWIRE_TOKEN"])
    return token


def straight_run(where: Path) -> tuple[list, dict]:
    """The records of the job run without a fault."""
    done = shardwire(
        *("launch", "--standalone", "--nproc-per-node", "2", "examples/digits.py"),
        *("--steps", STEPS, "--log-every", "100", "--run-dir", str(where / "run")),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_records(where / "run")


def node_agent(
    port: int | str, run_dir: Path, *netns: str, output: Path | None = None
) -> subprocess.Popen:
    """The job's node agent, dialing ``port`` on loopback (or the addresses given),
    inside network namespace ``netns[0]`` if given; its output in pipes, or in the files
    ``output``.out and .err (for a test that does not read it as it comes)."""
    where = port if isinstance(port, str) else f"127.0.0.1:{port}"
    argv = [
        *(["ip", "netns", "exec", netns[0]] if netns else []),
        SHARDWIRE,
        "worker",
        "--coordinator",
        where,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--run-id",
        "restart",
        "examples/digits.py",
        "--steps",
        STEPS,
        "--log-every",
        "100",
        "--run-dir",
        str(run_dir),
    ]
    if output is None:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        return subprocess.Popen(argv, cwd=ROOT, env=env(**TOKEN), **pipes)  # type: ignore[call-overload]
    with output.with_suffix(".out").open("w") as out, output.with_suffix(".err").open("w") as err:
        return subprocess.Popen(argv, cwd=ROOT, env=env(**TOKEN), stdout=out, stderr=err)


def until_step(agent: subprocess.Popen, step: int) -> None:
    assert agent.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = agent.stdout.readline()
        assert line, "the job ended before the coordinator could be killed"
        if f"step {step}/" in line:
            return
    raise AssertionError(f"step {step} not reached within 240 s")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def same_as_straight(run_dir: Path, straight: tuple[list, dict]) -> None:
    records, summary = run_records(run_dir)
    expected, expected_summary = straight
    assert records == expected  # every logged loss, rate and accuracy, bit for bit
    for key in ("final_loss", "held_out_accuracy"):
        assert summary[key] == expected_summary[key]
