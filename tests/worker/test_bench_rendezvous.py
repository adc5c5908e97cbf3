"""shardwire bench rendezvous: a real coordinator process admits simulated workers that
each look up their neighbours, and the run reports its figures (no speed is asserted)."""

from __future__ import annotations

import json

from shardwire.protocol import InvalidArgument
from shardwire.worker.bench.rendezvous import main, measure


def test_a_job_forms_and_the_figures_are_reported(tmp_path, capsys) -> None:
    result = measure(1000, 2, 8, beat_window=1.0)  # 125 agents and their workers
    assert result["workers"] == 1000 and result["processes"] == 2 and result["agents"]
    assert result["coordinator_exit"] == 0  # every simulated worker held all and left
    assert 0 < result["join_p50_s"] <= result["join_p99_s"] <= result["rendezvous_s"]
    assert result["coordinator_cpu_s"] > 0 and result["coordinator_peak_rss_mib"] > 10
    assert 0 <= result["heartbeat_cpu_share"] < 2  # CPU seconds per second, two cores
    out = tmp_path / "r.json"
    args = ["--workers", "24", "--processes", "1", "--per-node", "4", "--beat-window", "0.5"]
    assert main([*args, "--json", str(out)]) == 0
    assert "| 24 |" in capsys.readouterr().out
    written = json.loads(out.read_text())[0]
    assert written["workers"] == 24 and "heartbeat_cpu_share" in written
    assert written["agents"] is True
    assert main([*args, "--direct", "--json", str(out)]) == 0  # no agents: beats direct
    assert json.loads(out.read_text())[0]["agents"] is False


def test_workers_that_do_not_fill_their_nodes_are_refused_before_anything_starts() -> None:
    import pytest

    with pytest.raises(InvalidArgument, match="60 workers do not fill nodes of 8"):
        measure(60, 2, 8)
