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
                if len(server.rendezvous.losses) == 20 and len(server.rendezvous.links) == 2:
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
