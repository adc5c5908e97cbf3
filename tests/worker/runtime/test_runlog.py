"""A run directory holding another run's metrics is never truncated."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from shardwire.worker.runtime.runlog import RunDirInUse, RunLog


def _log(run_dir, **kw) -> RunLog:
    return RunLog(SimpleNamespace(rank=0, interactive=False), run_dir, 10, out=io.StringIO(), **kw)  # type: ignore[arg-type]


def test_an_explicit_directory_with_metrics_is_refused(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirInUse, match="already holds metrics.jsonl"):
        _log(run)
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_default_directory_in_use_moves_to_the_next_free_name(tmp_path) -> None:
    run = tmp_path / "digits"
    first = _log(run, next_free=True)
    assert first.run_dir == run
    second = _log(run, next_free=True)
    assert second.run_dir == run  # nothing written yet: metrics.jsonl is empty but present
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    third = _log(run, next_free=True)
    assert third.run_dir == tmp_path / "digits-2"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
