"""``shardwire bench``: a job-based benchmark runs its ranks as ``python -m`` modules of
the package, and those that train the examples say plainly when they do not run in a
checkout (every benchmark's help is in tests/e2e/test_help.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.bench.jobs import example

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")


@pytest.mark.e2e
def test_a_job_benchmark_runs_its_ranks_from_the_package(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    result = subprocess.run(
        [SHARDWIRE, "bench", "checkpoint", "--world", "1", "--mib", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["n"] == 1 and row["bytes"] > 0 and row["save_s"] > 0 and row["load_s"] > 0


def test_the_example_benchmarks_need_a_checkout(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="run this benchmark from a shardwire checkout"):
        example("charlm.py")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "charlm.py").write_text("")
    assert example("charlm.py") == tmp_path / "examples" / "charlm.py"


@pytest.mark.long(25)
@pytest.mark.e2e
def test_the_transport_benchmark_measures_every_variant_and_their_costs(tmp_path) -> None:
    out = tmp_path / "transport.json"
    result = subprocess.run(
        [
            SHARDWIRE,
            "bench",
            "transport",
            "--sizes",
            "64K",
            "1M",
            "--trials",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kept = json.loads(out.read_text())
    assert [r["size"] for r in kept["throughput"]] == [64 << 10, 1 << 20]
    for r in kept["throughput"]:
        for name in ("raw", "shardwire", "no checksum", "tcp only", "tls"):
            assert r[f"{name}_gbps"] > 0, r
        # TLS covers connections: it is measured over TCP only, against TCP only
        assert r["tls_cost"] == 1 - r["tls_gbps"] / r["tcp only_gbps"]
        assert r["checksum_cost"] == 1 - r["shardwire_gbps"] / r["no checksum_gbps"]
    assert set(kept["rtt_us"]) == {"raw", "shardwire", "no checksum", "tcp only", "tls"}
