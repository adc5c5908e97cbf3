"""A rank the coordinator declared failed is called hung only while its process runs:
one that died (a zombie, or reaped before asyncio was told) is said to have died, with
its signal where the kernel still holds it, and is not killed again."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys

import pytest

from shardwire.worker.launcher.exits import Exited, exited, failed_rank
from shardwire.worker.launcher.supervisor import Launch, Supervisor


def test_only_a_running_process_is_called_hung_and_killed() -> None:
    line, kill = failed_rank(3, None)
    assert kill and line == (
        "rank 3 failed while its process runs (hung?): killing it (SIGKILL) to start it anew"
    )
    line, kill = failed_rank(3, Exited(-signal.SIGKILL))
    assert (
        not kill
        and line == "rank 3 failed: its process had already ended (killed by signal SIGKILL)"
    )
    assert failed_rank(3, Exited(1)) == (
        "rank 3 failed: its process had already ended (exit code 1)",
        False,
    )
    assert failed_rank(3, Exited(None)) == ("rank 3 failed: its process had already ended", False)


@pytest.mark.e2e
def test_a_dead_child_s_status_is_read_without_reaping_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exited(child.pid) is None  # it runs
        os.kill(child.pid, signal.SIGSTOP)
        os.waitid(os.P_PID, child.pid, os.WSTOPPED | os.WNOWAIT)
        assert exited(child.pid) is None  # stopped is not ended: a hang
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie now
        assert exited(child.pid) == Exited(-signal.SIGKILL)
    finally:
        child.kill()
        assert child.wait(timeout=60) == -signal.SIGKILL  # still there for its owner to reap
    assert exited(child.pid) == Exited(None)  # reaped: ended, how no longer known here


SCRIPT = """
import os, time
if os.environ["SHARDWIRE_GENERATION"] != "0":  # the first process: it runs until killed
    print("running", flush=True)
    time.sleep(60)
"""


class _Output(io.StringIO):
    """A rank's output sink that sets ``running`` once the rank says it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.running = asyncio.Event()

    def write(self, text: str) -> int:
        if "running" in text:
            self.running.set()
        return super().write(text)


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_rank_killed_before_asyncio_reaped_it_is_not_called_hung(tmp_path) -> None:
    """The coordinator's word can come between the kill and the event loop's news of it:
    the agent says the process died, and its replacement (which exits 0) is started once
    it is reaped."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    launch = Launch(
        [sys.executable, "-u", str(script)],
        {**os.environ},
        "node-a",
        0,
        1,
        1,
        respawns=1,
    )
    out, err = _Output(), io.StringIO()
    supervisor = Supervisor(launch, out=out, err=err)
    run = asyncio.ensure_future(supervisor.run())
    async with asyncio.timeout(60):
        await out.running.wait()
    pid = supervisor.children[0].proc.pid
    os.kill(pid, signal.SIGKILL)
    # Blocks the loop on purpose until the process is dead: the loop must not hear of
    # the death before note_restart runs (asyncio's watcher thread may reap it first).
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # noqa: ASYNC222
    assert supervisor.children[0].proc.returncode is None  # the loop has not been told yet
    supervisor.note_restart(0)
    assert "[agent]: rank 0 failed: its process had already ended" in err.getvalue()
    assert "hung" not in err.getvalue()
    assert await asyncio.wait_for(run, 60) == 0, err.getvalue()
    assert "rank 0 killed by signal SIGKILL; started anew" in err.getvalue()


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_a_rank_of_a_node_told_to_stop_is_not_called_hung_but_left_its_grace(
    tmp_path,
) -> None:
    """SIGTERM to the agent under live recovery (a preemption notice): its ranks hand
    their state over and leave, and the coordinator names the first to leave as the
    generation's end. Its process is still ending: not hung, not killed, not replaced."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    launch = Launch(
        [sys.executable, "-u", str(script)], {**os.environ}, "node-a", 0, 1, 1, respawns=1
    )
    out, err = _Output(), io.StringIO()
    supervisor = Supervisor(launch, out=out, err=err)
    run = asyncio.ensure_future(supervisor.run())
    try:
        async with asyncio.timeout(60):
            await out.running.wait()
        supervisor.interrupted_by = signal.SIGTERM  # as the agent's handler sets it
        supervisor.note_restart(0)
        assert err.getvalue() == ""
        assert supervisor.children[0].proc.returncode is None  # left to end by itself
    finally:
        await supervisor.stop()
        await asyncio.wait_for(run, 60)
    assert "started anew" not in err.getvalue()
