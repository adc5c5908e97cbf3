"""Headless Chromium loads the status page of a live two-worker job: the rank table, the
links' heat map and the loss curve render. The screenshot is kept in test-artifacts/."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from shardwire.worker import init
from tests.worker.cluster import coordinator, status_http, worker_config

from .cli import ROOT, SHARDWIRE, env

pytestmark = pytest.mark.e2e
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--virtual-time-budget=4000",
    "--window-size=1000,800",
]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium on this machine (CI installs Debian's chromium package)")


async def _browser(*args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
    return out.decode(errors="replace")


async def test_status_page_renders_the_rank_table_and_loss_curve() -> None:
    browser = chromium()
    async with coordinator(2) as server, status_http(server) as base:
        url = f"{base}/"
        done = asyncio.Event()
        seen = asyncio.Event()

        async def worker(i: int):
            cfg = worker_config(server, 2, i, transport="tcp", heartbeat_interval=0.2)
            async with init(cfg) as pg:
                for step in range(1, 21):
                    await pg.all_reduce(np.ones(100))
                    pg.report_progress(step, 100.0, loss=2.0 / step)
                if pg.rank == 0:
                    seen.set()
                await done.wait()

        workers = asyncio.gather(worker(0), worker(1))
        try:
            await asyncio.wait_for(seen.wait(), 20)
            for _ in range(500):  # heartbeats travel on their own connections: bounded wait
                if len(server.rendezvous.curves.losses) == 20 and len(server.rendezvous.links) == 2:
                    break
                await asyncio.sleep(0.02)
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "status-page.png"
            dom = await _browser("--dump-dom", url)
            await _browser(f"--screenshot={shot}", url)
        finally:
            done.set()
            await workers
    assert browser
    rows = re.findall(r"<tr><td>(\d)</td><td class=\"text\">127\.0\.0\.1</td>", dom)
    assert rows == ["0", "1"], dom[:2000]
    assert "running" in dom
    path = re.search(r'<path d="(M[^"]+)"[^>]*id="loss-line"', dom)
    assert path is not None and path.group(1).count("L") == 19  # 20 points
    assert "job running" in dom  # the event log
    cells = re.findall(r'<rect id="link-(\d)-(\d)"[^>]*fill="hsl', dom)
    assert sorted(cells) == [("0", "1"), ("1", "0")], dom[:4000]  # one cell per direction
    assert re.search(r"<tr><td>0</td><td>1</td><td class=\"text\">tcp</td>", dom)
    assert shot.stat().st_size > 10_000


def _until(stream, needle: str) -> str:
    """Lines of ``stream`` up to the first holding ``needle`` (the job's own end bounds
    the wait: its output closes then)."""
    seen = []
    while line := stream.readline():
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} never came:\n" + "".join(seen[-40:]))


_PROGRESS = re.compile(r'id="progress-text">step (\d+) of 400 \((\d+) %\), about ([^<]+) left<')


def _line_points(dom: str, line_id: str) -> int:
    path = re.search(rf'<path d="(M[^"]+)"[^>]*id="{line_id}"', dom)
    return 0 if path is None else path.group(1).count("L") + 1


def test_a_person_reads_progress_time_left_and_both_losses_during_charlm(tmp_path) -> None:
    chromium()
    job = subprocess.Popen(
        [
            SHARDWIRE,
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/charlm.py",
            "--steps",
            "400",
            "--log-every",
            "20",
            "--dim",
            "32",
            "--layers",
            "2",
            "--heads",
            "4",
            "--sample",
            "5",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert job.stdout is not None  # one stream: nothing fills up unread
        line = _until(job.stdout, "status page on ")
        url = line.rsplit(" ", 1)[-1].strip()
        _until(job.stdout, "step 60/400")
        # the page follows rank 0's heartbeats (a second apart): on a fast machine the
        # first look may come before two of them carried a step, and the estimate with them
        for at in range(80, 220, 20):
            first = asyncio.run(_browser("--dump-dom", url))
            if (shown := _PROGRESS.search(first)) is not None:
                break
            _until(job.stdout, f"step {at}/400")
        assert shown is not None, first[:3000]
        # two held-out records past what the first look showed; the page learns of them
        # from heartbeats, which may trail the job's own output by a beat or two, so it
        # looks again as the job goes on (a busy machine's browser may take a while)
        held_out = _line_points(first, "held-out-line")
        again = (int(shown.group(1)) // 20 + 2) * 20
        for at in range(again, 420, 20):
            _until(job.stdout, f"step {at}/400")
            second = asyncio.run(_browser("--dump-dom", url))
            if _line_points(second, "held-out-line") >= held_out + 2:
                break
        ARTIFACTS.mkdir(exist_ok=True)
        asyncio.run(_browser(f"--screenshot={ARTIFACTS / 'status-page-charlm.png'}", url))
    finally:
        job.terminate()
        job.communicate(timeout=60)
    early, late = _PROGRESS.search(first), _PROGRESS.search(second)
    assert early is not None, first[:3000]
    assert late is not None, second[:3000]
    # the step moves on, against the run's total, with an estimate of the time left
    assert 60 <= int(early.group(1)) < int(late.group(1)) <= 400
    assert int(late.group(2)) == int(late.group(1)) * 100 // 400
    assert re.fullmatch(r"\d+ s|\d+ min \d+ s", late.group(3)), late.group(3)
    # held-out loss beside the training loss, throughput and waiting over the run
    assert _line_points(second, "held-out-line") >= held_out + 2
    assert _line_points(second, "loss-line") > _line_points(first, "loss-line")
    assert _line_points(second, "throughput-line") >= 2
    assert _line_points(second, "waiting-line") >= 2
    assert "held-out loss" in second and "samples/s" in second
    # the ranks share a node: their collectives go through the arena, and the links
    # carry next to nothing, so no cell of the heat map is dark
    shades = [
        int(x) for x in re.findall(r'<rect id="link-\d-\d"[^>]*fill="hsl\(210, 70%, (\d+)%', second)
    ]
    assert shades and min(shades) >= 85, shades
