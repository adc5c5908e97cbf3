"""Ray Train's ``TorchTrainer`` over the shardwire backend (``ShardwireConfig``), on a
real Ray cluster with Ray Train's own rendezvous: DDP and FSDP2 models train over
shardwire and end at the parameters one process computes on the whole batch."""

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


@pytest.mark.long(35)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_torch_trainer_trains_over_shardwire_to_the_single_process_result(
    ray_cluster: LocalCluster, wrap: str
) -> None:
    pytest.importorskip("torch", reason="torch is not installed (make torch)")
    pytest.importorskip("ray.train", reason="Ray Train is not installed (make ray)")
    done = subprocess.run(
        [sys.executable, str(DRIVER), ray_cluster.address, "shardwire", wrap],
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
    assert out["params"] == pytest.approx(out["oracle"], abs=1e-6)
    assert len(out["params"]) == 8 * 16 + 16 + 16 + 1
