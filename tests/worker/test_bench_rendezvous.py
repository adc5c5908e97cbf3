"""shardwire bench rendezvous: a real coordinator process admits simulated workers that
each look up their neighbours, and the run reports its figures (no speed is asserted)."""

from __future__ import annotations

import json

import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.bench.rendezvous import main, measure
from tests.etcdserver import etcd_server


@pytest.mark.e2e
def test_a_job_forms_and_the_figures_are_reported(tmp_path, capsys) -> None:
    result = measure(1000, 2, 8, beat_window=1.0, reform=True)  # 125 agents, their workers
    assert result["workers"] == 1000 and result["processes"] == 2 and result["agents"]
    assert result["coordinator_exit"] == 0  # every simulated worker held all and left
    # one worker failed; 999 re-formed in process and its replacement joined: the next
    # generation formed (and then finished, so the coordinator exited 0)
    assert 0 < result["reform_s"] < 120
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
    assert main([*args, "--direct", "--reform", "--json", str(out)]) == 0  # beats direct
    direct = json.loads(out.read_text())[0]
    assert direct["agents"] is False and direct["reform_s"] > 0
    assert "formed in process in" in capsys.readouterr().out


@pytest.mark.e2e
def test_a_coordinator_killed_and_started_again_takes_every_worker_back(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    args = ["--workers", "48", "--processes", "2", "--per-node", "4", "--beat-window", "0.5"]
    assert main([*args, "--restart", "--json", str(out)]) == 0
    result = json.loads(out.read_text())[0]
    # the job finished on the restarted coordinator: every worker was back and left
    assert result["coordinator_exit"] == 0 and result["reform_s"] is None
    assert 0 < result["coordinator_up_s"] < result["restart_s"] < 120
    assert "every worker and agent back after" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # separate runs: refused before any starts
        main([*args, "--restart", "--reform"])
    assert refused.value.code == 2
    assert "give one" in capsys.readouterr().err


def test_workers_that_do_not_fill_their_nodes_are_refused_before_anything_starts() -> None:
    with pytest.raises(InvalidArgument, match="60 workers do not fill nodes of 8"):
        measure(60, 2, 8)


@pytest.mark.e2e
def test_a_replica_over_etcd_forms_the_job_and_its_etcd_writes_are_counted(
    tmp_path, capsys
) -> None:
    out = tmp_path / "r.json"
    args = ["--workers", "32", "--processes", "1", "--per-node", "4", "--beat-window", "1"]
    with etcd_server(tmp_path / "etcd") as etcd:
        assert main([*args, "--etcd", etcd, "--json", str(out)]) == 0
    result = json.loads(out.read_text())[0]
    assert result["coordinator_exit"] == 0
    # the journal when the nodes are assigned and when the generation runs; nothing for
    # heartbeats
    assert 1 <= result["etcd_writes_forming"] <= 5 and result["etcd_put_bytes_forming"] > 100
    assert result["etcd_writes_per_s_running"] == 0
    assert "writes/s while every worker heartbeats" in capsys.readouterr().out
    without = measure(32, 1, 4, beat_window=0.5)
    assert without["etcd_writes_forming"] is None  # no etcd: nothing counted
