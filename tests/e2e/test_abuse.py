"""A live job under abuse: idle, garbage and trickling connections against every
listener (the coordinator, each worker's peer port, the HTTP port). Each process's
memory stays within 32 MiB of where it was, its descriptors come back within the
handshake deadline, and the job finishes with exactly the results of an undisturbed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator

import pytest

from .abuse import fd_count, idle_connections, open_count, rss_bytes, trickle
from .cli import SCRIPTS, background, start_coordinator

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.one_loop]

TOKEN = {"SHARDWIRE_TOKEN": "abuse-token"}
IDLE = 500  # per listener, under the 512 cap
GARBAGE = 50
STEPS = 60
RSS_BOUND = 32 << 20
DEADLINE = 10.0  # the handshake and HTTP request deadlines
GARBAGE_BYTES = b"GET / HTTP/1.1\r\n" + bytes(range(256)) * 8
# A valid-looking frame prefix announcing a 16 KiB meta that never comes.
PARTIAL_FRAME = b"SW\x02\x03\x00\x00\x40\x00" + b"\x00" * 8


def _read_until(stream, pattern: str, timeout: float = 90) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        assert line, f"output ended before {pattern!r}"
        if found := re.search(pattern, line):
            return found
    raise AssertionError(f"no {pattern!r} within {timeout:g} s")


def _job(steps: int, delay: float) -> tuple[subprocess.Popen, subprocess.Popen, str, str]:
    coordinator, port = start_coordinator("--world-size", "2", "--http-port", "0", **TOKEN)
    assert coordinator.stderr is not None
    http = _read_until(coordinator.stderr, r"status page on http://([\d.]+:\d+)/").group(1)
    node = background(
        "worker",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "steps.py"),
        STEPS=str(steps),
        STEP_DELAY=str(delay),
        **TOKEN,
    )
    return coordinator, node, port, http


def _totals(node: subprocess.Popen) -> dict[str, str]:
    out, err = node.communicate(timeout=120)
    assert node.returncode == 0, err
    return dict(re.findall(r"\[(rank\d)\]: done (\S+)", out))


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.mark.long(35)
async def test_abuse_of_every_listener_costs_little_and_changes_nothing() -> None:
    coordinator, node, _port, _http = _job(steps=STEPS, delay=0.0)
    try:
        reference = _totals(node)
    finally:
        _stop(coordinator, node)

    coordinator, node, port, http = _job(steps=STEPS, delay=0.5)
    try:
        assert node.stdout is not None
        workers = []
        for _ in range(2):
            found = _read_until(node.stdout, r"listening (\d+) pid (\d+)")
            workers.append((int(found.group(1)), int(found.group(2))))
        _read_until(node.stdout, r"step 1 ")
        targets = [(int(port), coordinator.pid)] + workers
        before = {pid: (rss_bytes(pid), fd_count(pid)) for _p, pid in targets}
        http_host, http_port = http.rsplit(":", 1)
        started = time.monotonic()
        async with _hold_all(targets) as held:
            slow = asyncio.gather(
                trickle(("127.0.0.1", workers[0][0]), interval=1.0, limit=3 * DEADLINE),
                trickle((http_host, int(http_port)), interval=1.0, limit=3 * DEADLINE),
            )
            await asyncio.sleep(1.0)
            for listener_port, pid in targets:
                grown = rss_bytes(pid) - before[pid][0]
                print(
                    f"pid {pid} port {listener_port}: rss +{grown / 2**20:.1f} MiB, fds "
                    f"{before[pid][1]} -> {fd_count(pid)}"
                )
                assert grown <= RSS_BOUND, (
                    f"pid {pid} (port {listener_port}) grew {grown >> 20} MiB"
                )
            async with asyncio.timeout(3 * DEADLINE):  # all dropped within the deadline
                for group in held:
                    await asyncio.gather(*(h.watcher for h in group))
            assert sum(open_count(group) for group in held) == 0
            dropped_at = time.monotonic() - started
            trickled = await slow
        assert dropped_at < 2 * DEADLINE + 5
        assert all(seconds < 2 * DEADLINE for seconds in trickled), trickled
        await asyncio.sleep(1.0)  # the servers' close callbacks have run by now
        for _p, pid in targets:
            assert fd_count(pid) <= before[pid][1] + 4, (pid, before[pid], fd_count(pid))
            assert rss_bytes(pid) - before[pid][0] <= RSS_BOUND
        assert _totals(node) == reference  # the job finished, with the same numbers
    finally:
        _stop(coordinator, node)


@contextlib.asynccontextmanager
async def _hold_all(targets: list[tuple[int, int]]) -> AsyncIterator[list]:
    """Idle, partial-frame and garbage connections against every target port."""
    async with contextlib.AsyncExitStack() as stack:
        groups = []
        for listener_port, _pid in targets:
            address = ("127.0.0.1", listener_port)
            for count, payload in ((IDLE, b""), (GARBAGE, PARTIAL_FRAME), (GARBAGE, GARBAGE_BYTES)):
                held = idle_connections(address, count, payload=payload)
                groups.append(await stack.enter_async_context(held))
        yield groups
