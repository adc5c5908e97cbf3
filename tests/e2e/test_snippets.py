"""The docs' Python samples run as written in real jobs, with the names the script
around them would define (``snippets.py``), and do what their pages say."""

from __future__ import annotations

import re

import pytest

from .cli import SCRIPTS, SHARDWIRE, run

pytestmark = pytest.mark.e2e

SCRIPT = str(SCRIPTS / "snippets.py")


def _launch(tmp_path, nproc: int, *args: str, recovery: str = "relaunch") -> str:
    launch = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", str(nproc)]
    launch += ["--recovery", recovery]
    done = run([*launch, SCRIPT, *args], cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _ran(out: str, label: str, nproc: int) -> None:
    assert len(re.findall(rf"^\[rank\d+\]: sample {label} ok$", out, re.M)) == nproc, out


def test_the_collectives_sample_computes_what_numpy_does(tmp_path) -> None:
    # three ranks: the sample gathers shards of 3, 3 and 2 rows
    _ran(_launch(tmp_path, 3, "sample-collectives"), "sample-collectives", 3)


def test_the_parallelism_samples_train_a_step_on_four_ranks(tmp_path) -> None:
    out = _launch(tmp_path, 4, "sample-tp", "sample-pipeline")
    _ran(out, "sample-tp", 4)
    _ran(out, "sample-pipeline", 4)


SAMPLES = [
    "sample-fsdp",
    "sample-offload",
    "sample-checkpoints",
    "sample-aggregation",
    "sample-held-state",
]


def test_the_training_samples_run_in_one_job(tmp_path) -> None:
    out = _launch(tmp_path, 2, *SAMPLES)
    for label in SAMPLES:
        _ran(out, label, 2)


@pytest.mark.parametrize("label", ["sample-live-recovery", "sample-live-leave"])
def test_the_elastic_samples_train_under_live_recovery(tmp_path, label: str) -> None:
    out = _launch(tmp_path, 2, "--session", label, recovery="live")
    _ran(out, label, 2)


def test_the_diloco_sample_trains_and_ends_with_the_global_parameters(tmp_path) -> None:
    _ran(_launch(tmp_path, 2, "--session", "sample-diloco"), "sample-diloco", 2)


def test_the_torch_sample_joins_the_job_as_a_torch_group(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed here (make torch)")
    _ran(_launch(tmp_path, 2, "--session", "sample-torch"), "sample-torch", 2)
