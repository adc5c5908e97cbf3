"""The main job end to end: digits on two workers, reproducible, with its run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from .cli import ROOT, SHARDWIRE, env, run_records, shardwire

pytestmark = pytest.mark.e2e

KEYS = {
    "step",
    "time_s",
    "loss",
    "lr",
    "accuracy",
    "samples_per_s",
    "bytes_sent",
    "bytes_received",
    "comm_s",
    "compute_s",
}


def _trained(run_dir, *flags: str) -> subprocess.CompletedProcess:
    """digits on 2 ranks for 150 steps, writing to ``run_dir``; it must succeed."""
    result = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/digits.py",
        "--steps",
        "150",
        "--run-dir",
        str(run_dir),
        *flags,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _run(run_dir) -> tuple[list[dict], dict]:
    result = _trained(run_dir)
    assert "[rank0]: held_out_accuracy" in result.stdout
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads((run_dir / "summary.json").read_text())


def test_digits_trains_to_accuracy_and_repeats_exactly(tmp_path) -> None:
    first, summary = _run(tmp_path / "a")
    second, again = _run(tmp_path / "b")
    assert summary["held_out_accuracy"] >= 0.95
    assert summary["held_out_accuracy"] == again["held_out_accuracy"]
    assert [r["step"] for r in first] == [25, 50, 75, 100, 125, 150]
    assert round(first[-1]["accuracy"], 4) == summary["held_out_accuracy"]
    for record in first:
        assert set(record) == KEYS
        assert len(record["bytes_sent"]) == 2 and min(record["bytes_sent"]) > 0
        # per rank and step: waiting for collectives, and the rest (both real)
        assert len(record["comm_s"]) == 2 and min(record["comm_s"]) > 0
        assert len(record["compute_s"]) == 2 and min(record["compute_s"]) > 0
    shares = summary["comm_share_per_rank"]
    assert len(shares) == 2 and all(0 < s < 1 for s in shares)
    assert [(r["loss"], r["lr"]) for r in first] == [(r["loss"], r["lr"]) for r in second]
    assert first[-1]["loss"] < first[0]["loss"]


def test_a_terminal_gets_a_progress_bar_tagged_with_the_rank(tmp_path) -> None:
    import os
    import subprocess

    from .cli import ROOT, SHARDWIRE, env

    primary, replica = os.openpty()
    proc = subprocess.Popen(
        [
            SHARDWIRE,
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/digits.py",
            "--steps",
            "60",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=replica,
        stderr=replica,
        env=env(),
        cwd=ROOT,
    )
    os.close(replica)
    output = b""
    try:
        while chunk := _read(primary):  # ends when the launcher closes the terminal
            output += chunk
    finally:
        os.close(primary)
        assert proc.wait(timeout=120) == 0
    text = output.decode(errors="replace")
    assert "\r[rank0]: " in text and "60/60" in text  # tqdm redraws in place, tagged
    assert "step 60/60" not in text  # no plain log lines on a terminal
    assert "[rank0]: held_out_accuracy" in text


def _read(fd: int) -> bytes:
    import os

    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other side of the terminal is gone
        return b""


@pytest.mark.slow
def test_make_run_passes_with_a_busy_process_per_core_and_no_bytecode_writes(tmp_path) -> None:
    import os
    import subprocess
    import sys

    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        result = shardwire(
            "launch",
            "--standalone",
            "--nproc-per-node",
            "4",
            "examples/digits.py",
            "--run-dir",
            str(tmp_path / "run"),
            timeout=600,
            PYTHONDONTWRITEBYTECODE="1",
        )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["held_out_accuracy"] >= 0.95
    assert "Traceback" not in result.stderr


def _digits(tmp_path, name: str, *flags: str) -> list[str]:
    where = tmp_path / name
    return [
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/digits.py",
        "--steps",
        "400",
        "--log-every",
        "25",
        "--save-every",
        "50",
        "--checkpoint-dir",
        str(where / "ckpt"),
        "--run-dir",
        str(where / "run"),
        *flags,
    ]


def _finish(argv: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(
        argv, check=False, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _records(tmp_path, name: str) -> tuple[dict, dict]:
    return run_records(tmp_path / name / "run")


# DiLoCo: two replicas of one rank, whose outer state (global parameters, Nesterov
# momentum, a fragment's exchange in flight at the save) resumes with the checkpoint
DILOCO = ("--diloco", "10", "--fragments", "2", "--overlap", "--outer-quantize", "int8")


@pytest.mark.parametrize("flags", [(), DILOCO], ids=["fsdp", "diloco"])
def test_digits_killed_and_started_again_finishes_exactly_like_an_uninterrupted_run(
    tmp_path, flags
) -> None:
    _finish(_digits(tmp_path, "straight", *flags))
    killed = subprocess.Popen(
        _digits(tmp_path, "killed", *flags),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: the test kills all of it
    )
    try:
        assert killed.stdout is not None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = killed.stdout.readline()
            assert line, "the run ended before it could be killed"
            if "step 275/400" in line:
                break
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # launcher, coordinator and workers at once
        killed.wait(timeout=60)
    again = _finish(_digits(tmp_path, "killed", *flags))  # the same command again
    assert "resuming" in again.stdout
    straight, summary = _records(tmp_path, "straight")
    resumed, summary_resumed = _records(tmp_path, "killed")
    assert resumed == straight  # every logged loss, learning rate and accuracy, bit for bit
    for key in ("final_loss", "held_out_accuracy"):
        assert summary_resumed[key] == summary[key]
    if flags:  # each replica's checkpoints, and the outer state beside them
        states = sorted(p.name for p in (tmp_path / "killed" / "ckpt").glob("replica-*/diloco/*"))
        assert states == sorted(f"step-{s:08d}-rank-{r}.st" for r in (0, 1) for s in (350, 400))
        assert summary["held_out_accuracy"] >= 0.9


def _summary(tmp_path, name: str, *flags: str) -> dict:
    _trained(tmp_path / name, *flags)
    return json.loads((tmp_path / name / "summary.json").read_text())


def test_aggregators_train_like_fsdp_and_top_k_sends_far_less(tmp_path) -> None:
    fsdp = _summary(tmp_path, "fsdp")
    server = _summary(tmp_path, "ps", "--aggregator", "ps")
    ring = _summary(tmp_path, "ring", "--aggregator", "allreduce")
    sparse = _summary(tmp_path, "topk", "--aggregator", "allreduce", "--compress", "topk:0.01")
    # the same averaged gradients, so the same model (float32 sums: to 4 decimals)
    assert server["final_loss"] == ring["final_loss"]
    assert abs(server["final_loss"] - fsdp["final_loss"]) < 1e-4
    assert server["held_out_accuracy"] == fsdp["held_out_accuracy"]
    full, few = ring["grad_MiB_sent_per_rank"][0], sparse["grad_MiB_sent_per_rank"][0]
    assert full / few >= 20
    assert sparse["held_out_accuracy"] > 0.8


def test_digits_takes_diloco_s_outer_optimizer_from_its_flags(tmp_path) -> None:
    diloco = ("--diloco", "5", "--replicas", "2")
    paper = _summary(tmp_path, "paper", *diloco)
    averaged = _summary(tmp_path, "averaged", *diloco, "--outer-lr", "1", "--outer-momentum", "0")
    assert (paper["diloco"]["outer_lr"], paper["diloco"]["outer_momentum"]) == (0.7, 0.9)
    assert (averaged["diloco"]["outer_lr"], averaged["diloco"]["outer_momentum"]) == (1.0, 0.0)
    assert averaged["final_loss"] != paper["final_loss"]
