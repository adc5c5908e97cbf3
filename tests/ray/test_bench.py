"""``shardwire bench ray``, small: both parts run on the local cluster it starts, each
system in turn, and the table and JSON say what each gave."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli import ROOT, SHARDWIRE, run

from .conftest import LOOPBACK

pytestmark = pytest.mark.e2e


@pytest.mark.long(150)
@pytest.mark.timeout(900)
def test_the_ray_benchmark_times_both_parts_side_by_side(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (make torch)")
    pytest.importorskip("ray.train", reason="Ray Train is not installed (make ray)")
    out = tmp_path / "ray.json"
    flags = ["--pairs", "1", "--nproc", "2", "--minutes", "0.15", "--goodput-minutes", "0.2"]
    # One kill 6.6 s into each faulty job, the next 91 s in (seed 35's draws at a mean of
    # 20 s): a kill every 5 s on average outpaced Ray's restart of an actor on a loaded
    # machine (7.6 s with a busy loop per core), and the job never got its steps done
    flags += ["--every", "20", "--seed", "35"]
    done = run(
        [SHARDWIRE, "bench", "ray", *flags, "--json", str(out)], cwd=ROOT, timeout=800, **LOOPBACK
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (pair,) = result["throughput"]["pairs"]
    assert set(pair["tokens_per_s"]) == {"shardwire", "gloo"} and pair["ratio"] > 0
    modes = result["goodput"]["modes"]
    assert set(modes) == {"ray", "launch"}
    for mode in modes.values():
        assert mode["finished"] and mode["goodput"] > 0  # above 1 when load slowed the clean run
        assert mode["goodput"] == pytest.approx(mode["clean_s"] / mode["faulty_s"], abs=0.01)
    assert modes["ray"]["faults"] >= 1  # the kill landed while the job on Ray ran
    assert "median ratio" in done.stdout and "ray minus launch" in done.stdout
    assert "[ray] 7/7" in done.stderr
