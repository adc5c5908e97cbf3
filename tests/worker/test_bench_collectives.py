"""The collectives benchmark's comparison with the TCP-only path (without running it)."""

from __future__ import annotations

import json
from pathlib import Path

from shardwire.worker.bench import collectives


def test_compare_tcp_runs_a_second_job_with_shared_memory_off(monkeypatch, capsys) -> None:
    seen: list[str] = []

    def fake_run(cmd, *, env, **kwargs):
        seen.append(env["SHARDWIRE_TRANSPORT"])
        median = 0.001 if env["SHARDWIRE_TRANSPORT"] == "auto" else 0.004
        cell = {"n": 2, "op": "all_reduce", "bytes": 1 << 20, "algorithm": "ring"}
        cell.update(median_s=median, iters=10)
        Path(cmd[-2]).write_text(json.dumps([cell]))

    monkeypatch.setattr(collectives.subprocess, "run", fake_run)
    assert collectives.main(["--world", "4", "--sizes", "1M", "--compare-tcp"]) == 0
    assert seen == ["auto", "tcp"]
    out = capsys.readouterr().out
    assert "tcp only busbw" in out and "| 4.00x |" in out
    seen.clear()
    assert collectives.main(["--world", "4", "--sizes", "1M"]) == 0
    assert seen == ["auto"]
    assert "tcp only" not in capsys.readouterr().out
