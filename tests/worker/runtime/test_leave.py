"""SIGTERM as a notice to leave: an armed notice records it and keeps the process; one
nobody acts on ends the process of SIGTERM after its grace; disarmed, SIGTERM ends the
process at once. Each case runs in a process of its own (signals are process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from shardwire.protocol import RecoveryError
from shardwire.worker.api import Session
from shardwire.worker.runtime.worker_config import WorkerConfig

PROGRAM = """
import asyncio, os, signal, sys, time
from shardwire.worker.runtime.leave import LeaveNotice

async def main():
    notice = LeaveNotice(5, grace={grace})
    assert notice.arm() and not notice.requested
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(0.2)
    print("requested", notice.requested, flush=True)
    if {disarm}:
        notice.disarm()
        os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.sleep(30)
    print("still here", flush=True)

asyncio.run(main())
"""


def _run(grace: float, *, disarm: bool) -> tuple[subprocess.CompletedProcess, float]:
    code = textwrap.dedent(PROGRAM).format(grace=grace, disarm=disarm)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    return done, time.monotonic() - start


@pytest.mark.e2e
def test_a_notice_nobody_acts_on_ends_the_process_of_sigterm_after_its_grace() -> None:
    done, took = _run(1.0, disarm=False)
    assert done.returncode == -15, done.stderr
    assert "requested True" in done.stdout and "still here" not in done.stdout
    assert "rank 5 got SIGTERM: it leaves at its next copy step" in done.stderr
    assert "rank 5: no copy step within 1 s of SIGTERM" in done.stderr
    assert took < 25  # the grace, not the 30 s sleep


@pytest.mark.e2e
def test_a_disarmed_notice_gives_sigterm_its_default_action_back() -> None:
    done, _took = _run(60.0, disarm=True)
    assert done.returncode == -15, done.stderr
    assert "requested True" in done.stdout and "still here" not in done.stdout
    assert "no copy step" not in done.stderr


def test_a_notice_needs_live_recovery() -> None:
    config = WorkerConfig(coordinator=("127.0.0.1", 1), world_size=2, recovery="relaunch")
    session = Session(config)
    with pytest.raises(RecoveryError, match="needs live recovery"):
        session.leave_notice()


NO_LOOP = """
import os, signal, time
from shardwire.worker.runtime.leave import LeaveNotice

notice = LeaveNotice(3, grace={grace}, point="its next hand-over")
assert notice.arm() and not notice.requested  # the main thread, no event loop (torch's)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("requested", notice.requested, flush=True)
if {disarm}:
    notice.disarm()
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("still here", flush=True)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("disarm", [False, True])
def test_a_notice_without_an_event_loop_keeps_the_process_for_its_grace(disarm: bool) -> None:
    code = textwrap.dedent(NO_LOOP).format(grace=1.0 if not disarm else 60.0, disarm=disarm)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    took = time.monotonic() - start
    assert "requested True" in done.stdout and "still here" not in done.stdout, done.stderr
    assert "rank 3 got SIGTERM: it leaves at its next hand-over" in done.stderr
    if disarm:
        assert done.returncode == -15  # SIGTERM's own action again
    else:
        assert done.returncode == 128 + 15  # the grace's end, from its timer thread
        assert "rank 3: no hand-over within 1 s of SIGTERM" in done.stderr
        assert took < 25
