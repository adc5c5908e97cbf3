"""``shardwire launch --trace``: every rank's timeline in Chrome's trace-event format, the
merged job trace with one track per rank, on one clock (the coordinator's)."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from .cli import shardwire

pytestmark = pytest.mark.e2e
PHASES = {"X", "b", "e", "M"}


def _digits(tmp_path: Path, *flags: str) -> None:
    done = shardwire(
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        *flags,
        "examples/digits.py",
        "--steps",
        "30",
        "--log-every",
        "10",
        "--run-dir",
        str(tmp_path / "run"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _check_format(events: list[dict]) -> None:
    """The trace-event format's rules for the phases used here."""
    for e in events:
        assert e["ph"] in PHASES and isinstance(e["name"], str) and isinstance(e["pid"], int), e
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index"} and "args" in e
            continue
        assert isinstance(e["ts"], float | int) and isinstance(e["tid"], int), e
        assert isinstance(e.get("cat"), str), e
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
        else:
            assert isinstance(e["id"], str), e
    # async slices pair up, and end after they begin
    begins = {(e["pid"], e["id"]): e["ts"] for e in events if e["ph"] == "b"}
    ends = {(e["pid"], e["id"]): e["ts"] for e in events if e["ph"] == "e"}
    assert begins.keys() == ends.keys()
    assert all(ends[k] >= begins[k] for k in begins)


def _check_nesting(events: list[dict]) -> None:
    """Complete events on one thread's track nest: none ends inside another it began in."""
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        open_ends: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1.0, (start, end, open_ends[-1])
            open_ends.append(end)


@pytest.mark.timeout(300)
def test_a_traced_job_leaves_every_ranks_timeline_and_the_merged_one(tmp_path) -> None:
    where = tmp_path / "trace"
    _digits(tmp_path, "--trace", "--trace-dir", str(where))
    assert sorted(p.name for p in where.iterdir()) == ["job.json", "rank-0.json", "rank-1.json"]
    job = json.loads((where / "job.json").read_text())["traceEvents"]
    _check_format(job)
    _check_nesting(job)
    names = {e["args"]["name"] for e in job if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}  # one track per rank
    kinds = Counter((e["pid"], e["cat"], e["name"]) for e in job if e["ph"] in {"X", "b"})
    for rank in (0, 1):
        assert kinds[rank, "user", "data"] == 30  # the script's sw.span, once a step
        for phase in ("forward", "backward", "optimizer", "reduce-scatter wait"):
            assert kinds[rank, "fsdp", phase] >= 30, (phase, kinds)
        assert kinds[rank, "fsdp", "all-gather wait 0"] >= 30
        assert kinds[rank, "collective", "all_gather"] >= 60
    collectives = [e for e in job if e["ph"] == "b"]
    assert {e["args"]["path"] for e in collectives} >= {"arena"}
    assert all(e["args"]["outcome"] == "ok" and e["args"]["seq"] >= 1 for e in collectives)
    # every collective's time, split into waiting, reducing and moving bytes
    split = ("wait_ms", "reduce_ms", "move_ms")
    assert all(min(e["args"][k] for k in split) >= 0 for e in collectives)
    assert sum(e["args"]["wait_ms"] for e in collectives) > 0
    reductions = [e for e in collectives if e["name"] in ("all_reduce", "reduce_scatter")]
    assert reductions and sum(e["args"]["reduce_ms"] for e in reductions) > 0
    # one clock: both ranks end each collective at about the same moment
    ends: dict[str, dict[int, float]] = defaultdict(dict)
    for e in job:
        if e["ph"] == "e":
            ends[e["id"]][e["pid"]] = e["ts"]
    skew = [abs(t[0] - t[1]) for t in ends.values() if len(t) == 2]
    assert len(skew) >= 100 and statistics.median(skew) < 20_000, statistics.median(skew)
    for rank in (0, 1):
        other = json.loads((where / f"rank-{rank}.json").read_text())["otherData"]
        assert other["rank"] == rank and other["dropped_events"] == 0
        assert 0 <= other["clock_error_s"] < 0.5
    # merged again from the rank files, by the command
    (where / "job.json").unlink()
    merged = shardwire("trace", "merge", str(where))
    assert merged.returncode == 0 and "2 ranks (0, 1)" in merged.stdout, merged.stderr
    assert json.loads((where / "job.json").read_text())["traceEvents"] == job


@pytest.mark.timeout(300)
def test_without_trace_nothing_is_recorded(tmp_path) -> None:
    _digits(tmp_path, "--trace-dir", str(tmp_path / "trace"))
    assert not (tmp_path / "trace").exists()
