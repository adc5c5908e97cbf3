"""A rank slowed on purpose is named as the straggler, with how late it is, on every
status view (the JSON the page draws, /metrics)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request

import pytest

from tests.docblocks import block

from .faults import job
from .pageruns import assert_shows, run_page_command

pytestmark = [pytest.mark.e2e, pytest.mark.one_loop]  # the job is the test; its loop is not


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        return response.read().decode()


@pytest.mark.timeout(300)
async def test_a_slowed_rank_is_named_the_straggler() -> None:
    async with job(3, STEPS="400", SLOW_RANK="1", SLOW_SECONDS="0.03") as j:
        await j.workers[0].line(r"^step 30 ", timeout=120)
        status: dict = {}
        for _ in range(60):  # heartbeats carry the timings once a second
            status = json.loads(await asyncio.to_thread(_get, j.url("/api/status")))
            if status["straggler"]:
                break
            await asyncio.sleep(0.5)
        text = status["straggler"]
        m = re.fullmatch(
            r"rank 1 \(127\.0\.0\.1\) was last into (\d+)% of its collectives "
            r"\(of the last \d+\), (\d+) ms late on average",
            text,
        )
        assert m, status
        assert int(m.group(1)) >= 70 and 10 <= int(m.group(2)) <= 500, text
        metrics = await asyncio.to_thread(_get, j.url("/metrics"))
        assert re.search(r"^shardwire_straggler_rank 1\.0$", metrics, re.M), metrics
        share = re.search(r'^shardwire_rank_last_share\{rank="1"\} (\S+)$', metrics, re.M)
        assert share and float(share.group(1)) >= 0.7


def test_the_job_ends_with_the_straggler_line(tmp_path) -> None:
    done = run_page_command("slowdemo", tmp_path, timeout=240)  # why-slow's own run
    assert done.returncode == 0, done.stderr[-3000:]
    assert_shows(block("slowdemo").output(), done.stderr)
    assert re.search(
        r"^\[coordinator\]: straggler: rank 3 \(127\.0\.0\.1\) was last into \d+% of its "
        r"collectives \(of the last \d+\), \d+ ms late on average$",
        done.stderr,
        re.M,
    ), done.stderr[-3000:]
    traces = tmp_path / "traces" / "slowdemo"  # where the page says --trace writes
    written = sorted(p.name for p in traces.iterdir())
    assert written == sorted(["job.json", *(f"rank-{r}.json" for r in range(4))])
