"""The main job end to end: digits on two workers, reproducible, with its run directory."""

from __future__ import annotations

import json

import pytest

from .cli import shardwire

pytestmark = pytest.mark.e2e

KEYS = {"step", "time_s", "loss", "lr", "accuracy", "samples_per_s", "bytes_sent", "bytes_received"}


def _run(run_dir) -> tuple[list[dict], dict]:
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
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
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
    assert [(r["loss"], r["lr"]) for r in first] == [(r["loss"], r["lr"]) for r in second]
    assert first[-1]["loss"] < first[0]["loss"]
