"""The status views move while a job runs: between two of the script's log points, the
coordinator's step, samples/s and loss curve (what the status page draws and /metrics
exports) advance every second, carried by the node agent's batched heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request

import pytest

from .cli import ROOT, SHARDWIRE, env

pytestmark = [pytest.mark.e2e, pytest.mark.one_loop]  # the job is the test; its loop is not
STEPS = 100_000  # the only log point is the last step, which the test never waits for


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        return response.read().decode()


async def _status(base: str) -> dict:
    return json.loads(await asyncio.to_thread(_get, base + "api/status"))


@pytest.mark.timeout(300)
async def test_step_and_loss_advance_between_log_points(tmp_path) -> None:
    proc = await asyncio.create_subprocess_exec(
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/digits.py",
        "--steps",
        str(STEPS),
        "--log-every",
        str(STEPS),
        "--run-dir",
        str(tmp_path / "run"),
        cwd=ROOT,
        env=env(),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(120):
            while not (
                m := re.search(rb"status page on (http://\S+/)", await proc.stderr.readline())
            ):
                pass
        base = m.group(1).decode()
        seen: list[tuple[int, int]] = []
        for _ in range(120):  # at most about a minute
            status = await _status(base)
            steps = [r["step"] for r in status["ranks"]]
            if steps and min(steps) > 0:
                seen.append((min(steps), len(status["losses"])))
                if len(seen) == 3:
                    break
                await asyncio.sleep(1.5)
            else:
                await asyncio.sleep(0.5)
        assert len(seen) == 3, f"no progress reached the coordinator: {status['ranks']}"
        (s1, l1), (s2, l2), (s3, l3) = seen
        assert s1 < s2 < s3 < STEPS, seen  # every rank moves, long before a log point
        assert 0 < l1 < l2 < l3, seen  # rank 0's loss curve grows
        rows = status["ranks"]
        assert all(r["samples_per_s"] > 0 and r["loss"] is not None for r in rows), rows
        assert all(r["bytes_sent"] > 0 for r in rows), rows
        metrics = await asyncio.to_thread(_get, base + "metrics")
        (step_max,) = re.findall(r"^shardwire_step_max (\S+)$", metrics, re.M)
        assert float(step_max) >= s3
        # the node agent carried the workers' heartbeats and progress, every one of them
        via = dict(re.findall(r'^shardwire_heartbeats_total\{via="(\w+)"\} (\S+)$', metrics, re.M))
        assert float(via["agent"]) >= 2 * 4 and float(via["worker"]) == 0, via
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
