"""The torch example and the torch columns of the benchmarks run as documented."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (`make torch` installs its CPU build)")

from shardwire.worker.bench.torchrun import run_ranks  # noqa: E402

from .spawn import SHARDWIRE, launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_charlm.py"
SMALL = ["--steps", "3", "--dim", "32", "--layers", "1", "--batch", "8", "--context", "16"]


def test_torch_charlm_under_shardwire_launch_trains_like_gloo(tmp_path):
    ours = tmp_path / "shardwire.json"
    done = launch("--nproc-per-node", "2", str(EXAMPLE), *SMALL, "--json", str(ours))
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = tmp_path / "gloo.json"
    argv = [sys.executable, str(EXAMPLE), *SMALL, "--backend", "gloo", "--json", str(theirs)]
    run_ranks(2, argv, logs=tmp_path / "gloo", timeout=240).check()
    a, b = json.loads(ours.read_text()), json.loads(theirs.read_text())
    assert (a["backend"], b["backend"]) == ("shardwire", "gloo")
    assert a["train_loss"] == b["train_loss"] and a["tokens_per_s"] > 0


def test_bench_collectives_compares_torch_on_shardwire_with_gloo(tmp_path):
    import subprocess

    out = tmp_path / "rows.json"
    cmd = [SHARDWIRE, "bench", "collectives", "--world", "2", "--sizes", "64K", "--ops",
           "all_reduce", "--target-s", "0.1", "--compare-gloo", "--compare-torch",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["torch_median_us"] > 0 and row["gloo_median_us"] > 0
    assert row["torch_vs_gloo"] == pytest.approx(row["gloo_median_us"] / row["torch_median_us"])
    assert "c10d on shardwire" in done.stdout
