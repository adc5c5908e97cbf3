"""The language-model example end to end with tensor parallelism inside pairs of ranks and
FSDP across the pairs."""

from __future__ import annotations

import pytest

from .cli import shardwire

pytestmark = pytest.mark.e2e


def _losses(stdout: str) -> list[float]:
    """The training losses rank 0 logged, in order."""
    return [
        float(line.split(" loss ")[1].split()[0])
        for line in stdout.splitlines()
        if "[rank0]: step " in line and " loss " in line
    ]


def test_charlm_with_tensor_parallel_pairs_trains(tmp_path) -> None:
    result = shardwire(
        "launch", "--standalone", "--nproc-per-node", "4", "examples/charlm.py",
        "--tp", "2", "--steps", "30", "--log-every", "15", "--dim", "32", "--layers", "2",
        "--sample", "10", "--run-dir", str(tmp_path / "run"),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(result.stdout)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "held_out_nats_per_char" in result.stdout


def test_charlm_as_two_pipelines_of_two_stages_trains(tmp_path) -> None:
    result = shardwire(
        "launch", "--standalone", "--nproc-per-node", "4", "examples/charlm.py",
        "--pp", "2", "--micro-batches", "4", "--steps", "30", "--log-every", "15",
        "--dim", "32", "--layers", "2", "--run-dir", str(tmp_path / "run"),
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(result.stdout)
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "[rank0]: micro_batches" in result.stdout
