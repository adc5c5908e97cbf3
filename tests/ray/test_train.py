"""Ray Train's ``TorchTrainer`` over the shardwire backend (``ShardwireConfig``), on a
real Ray cluster with Ray Train's own rendezvous: a DDP model and then an FSDP2 model
train over shardwire in one trainer run and each ends at the parameters one process
computes on the whole batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cli import ROOT, env

from .conftest import LOOPBACK, LocalCluster

pytestmark = pytest.mark.e2e
DRIVER = Path(__file__).parent / "scripts" / "train_driver.py"


@pytest.mark.long(40)
def test_torch_trainer_trains_ddp_and_fsdp2_over_shardwire_to_the_single_process_result(
    ray_cluster: LocalCluster,
) -> None:
    pytest.importorskip("torch", reason="torch is not installed (make torch)")
    pytest.importorskip("ray.train", reason="Ray Train is not installed (make ray)")
    done = subprocess.run(
        [sys.executable, str(DRIVER), ray_cluster.address, "shardwire"],
        cwd=ROOT,
        env=env(**LOOPBACK),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "shardwire" and out["world"] == 2
    for wrap in ("ddp", "fsdp2"):  # one trainer run, each model in turn
        assert len(out[wrap]) == 8 * 16 + 16 + 16 + 1
        assert out[wrap] == pytest.approx(out["oracle"], abs=1e-6), wrap
