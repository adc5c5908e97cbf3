"""Liveness with real processes: busy ranks live on, stopped and dead ranks are caught,
and a hang names the rank that never arrived and where it is."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import aiohttp
import pytest

from shardwire.coordinator import JobState
from tests.docblocks import block

from .cli import SCRIPTS
from .faults import Job, job
from .pageruns import assert_shows, run_page_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.one_loop]


def _marker_line(marker: str) -> int:
    lines = (SCRIPTS / "steps.py").read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if f"marker: {marker}" in text)


async def _busy_rows(job: Job, pattern: str, *, timeout: float) -> dict:
    """Poll /api/status (bounded) until a rank is reported busy at ``pattern``."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(timeout):
        while True:
            async with http.get(job.url("/api/status")) as response:
                status = await response.json()
            busy = [r for r in status["ranks"] if r["busy_s"] > 0]
            if busy and re.fullmatch(pattern, busy[0]["busy_at"]):
                return {"row": busy[0], "status": status}
            await asyncio.sleep(0.1)


@pytest.mark.parametrize("mode", ["sleep", "numpy"])
async def test_a_rank_blocking_its_loop_is_reported_busy_and_the_job_finishes(mode) -> None:
    # The loop blocks for 3x the heartbeat timeout; heartbeats come from another thread.
    blocked, heartbeat_timeout = 6.0, 2.0
    async with job(
        2,
        heartbeat_timeout=heartbeat_timeout,
        STEPS="6",
        STALL_RANK="1",
        STALL_AT="3",
        STALL_MODE=mode,
        STALL_SECONDS=str(blocked),
        SHARDWIRE_STALL_WARN="1",
        SHARDWIRE_HEARTBEAT_INTERVAL="0.25",
    ) as j:
        await j.workers[1].line("stalling")
        where = (
            rf"steps\.py:{_marker_line('nap-sleep')} in nap"
            if mode == "sleep"
            else r"steps\.py:\d+ in crunch"
        )
        seen = await _busy_rows(j, where, timeout=blocked)
        await j.wait()
    assert seen["row"]["rank"] == 1 and seen["row"]["state"] == "running"
    assert seen["status"]["state"] == "running"
    assert ("nap" if mode == "sleep" else "crunch") in seen["row"]["busy_stack"]
    assert [w.proc.returncode for w in j.workers] == [0, 0]
    # step s all-reduces s + 0 and s + 1: the sum over 6 steps is 2 * 15 + 6 = 36
    assert all(w.out[-1] == "done 36" for w in j.workers), [w.out[-3:] for w in j.workers]
    assert j.server.rendezvous.state is JobState.FINISHED
    events = [text for _t, text in j.server.rendezvous.events]
    assert any(re.search(rf"rank 1 busy for \d+ s at {where}", e) for e in events), events
    assert any("rank 1 responsive again" in e for e in events), events


@pytest.mark.parametrize(
    ("sig", "reason", "bound"),
    [
        # 5 s heartbeat timeout with 1 s heartbeats: caught 4-5 s after the stop
        (signal.SIGSTOP, "no heartbeat", 8.0),
        # the kernel closes a dead process's sockets: caught at once
        (signal.SIGKILL, "", 3.0),
    ],
)
async def test_a_stopped_or_killed_rank_fails_every_other_rank_naming_it(sig, reason, bound):
    async with job(3, STEPS="100000", STEP_DELAY="0.01") as j:
        await j.workers[1].line(r"^step 5 ")
        j.workers[1].signal(sig)
        struck = time.monotonic()
        await j.wait([0, 2], timeout=60)
        for w in (j.workers[0], j.workers[2]):
            assert w.proc.returncode == 1
            assert f"stopped: rank 1 failed: {reason}" in "\n".join(w.err), w.err
            assert w.exited_at is not None and w.exited_at - struck < bound
    failure = j.server.rendezvous.failure
    assert failure is not None and failure.rank == 1 and reason in failure.reason


async def test_a_rank_that_skips_a_collective_is_named_with_its_stack() -> None:
    async with job(3, STEPS="20", SKIP_RANK="2", SKIP_AT="4", SHARDWIRE_TIMEOUT="3") as j:
        await j.wait([0, 1], timeout=60)
        await asyncio.wait_for(j.server.done.wait(), 30)
    failure = j.server.rendezvous.failure
    assert failure is not None
    line = _marker_line("dawdle-await")
    # all_reduce #5 is step 4's (sequence numbers count from 1)
    assert failure.rank == 2
    assert re.match(
        rf"rank 2 never entered all_reduce #5 \(ranks 0-1 waited \d+ s\); "
        rf"rank 2 is at steps\.py:{line} in dawdle, after all_reduce #4 \(ok\)",
        failure.reason,
    ), failure.reason
    assert "in dawdle" in failure.stacks and "--- rank 2 ---" in failure.stacks
    for w in j.workers[:2]:
        assert w.proc.returncode == 1
        assert "CollectiveTimeout" in "\n".join(w.err)


def test_the_launcher_log_shows_a_busy_rank_and_the_job_goes_on(tmp_path) -> None:
    result = run_page_command("busy-rank-output", tmp_path)  # the failures page's run
    assert result.returncode == 0, result.stderr[-3000:]
    assert_shows(block("busy-rank-output").output(), result.stderr)
    line = _marker_line("nap-sleep")
    assert re.search(
        rf"^\[coordinator\]: rank 1 busy for \d+ s at steps\.py:{line} in nap \(its event "
        r"loop is not running; heartbeats continue, the job goes on\)$",
        result.stderr,
        re.M,
    ), result.stderr
    assert "[coordinator]: rank 1 responsive again" in result.stderr
    assert "Traceback" not in result.stderr  # a clean end prints no traceback


def test_the_launcher_summary_names_the_rank_that_never_arrived(tmp_path) -> None:
    result = run_page_command("failure-report-output", tmp_path)  # the failures page's run
    assert result.returncode != 0
    assert_shows(block("failure-report-output").output(), result.stderr)
    summary = result.stderr[result.stderr.index("shardwire: job failed") :]
    inquest = tmp_path / "inquests" / "shardwire-generation-1-inquest.json"  # ./inquests
    assert str(inquest) in summary  # the verdict names the file with every rank's detail
    detail = json.loads(inquest.read_text())
    assert detail["absent"] == [2] and detail["entered"] == [0, 1]
    assert "in dawdle" in detail["ranks"]["2"]["stack"]
    line = _marker_line("dawdle-await")
    assert re.search(
        r"root cause \(from the coordinator\): rank 2: rank 2 never entered all_reduce #4 "
        rf"\(ranks 0-1 waited \d+ s\); rank 2 is at steps\.py:{line} in dawdle",
        summary,
    ), summary
    assert "where the ranks that did not arrive were:" in summary
    assert re.search(rf'File ".*steps\.py", line {line}, in dawdle', summary), summary
    coordinator_lines = [x for x in result.stderr.splitlines() if x.startswith("[coordinator]")]
    assert not any("Traceback" in x or "CancelledError" in x for x in coordinator_lines)
