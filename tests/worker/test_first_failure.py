"""When a node's rank dies, its siblings end by themselves first: they learn of it from
their peers and the coordinator and end with an error naming it. Only one that has not
ended within ``term_timeout`` (busy outside any collective) is sent SIGTERM; a generation
that ended elsewhere stops them at once."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import time

import pytest

from shardwire.worker.launcher.supervisor import Launch, Supervisor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    sys.exit(3)  # the first failure
if rank == 2:
    time.sleep(0.5)  # learns of it, as from its peers, and ends with its own error
    sys.exit(4)
time.sleep(float(sys.argv[1]))  # rank 0: busy, outside any collective
"""


def _launch(tmp_path, term_timeout: float, busy_s: float) -> Launch:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-u", str(script), str(busy_s)]
    return Launch(argv, {**os.environ}, "node-a", 0, 3, 3, term_timeout=term_timeout)


async def test_siblings_end_on_their_own_and_the_busy_one_is_stopped_after_the_grace(
    tmp_path,
) -> None:
    err = io.StringIO()
    supervisor = Supervisor(_launch(tmp_path, 3.0, 60.0), out=io.StringIO(), err=err)
    started = time.monotonic()
    assert await asyncio.wait_for(supervisor.run(), 60) == 3
    took = time.monotonic() - started
    outcomes = {c.rank: c.outcome() for c in supervisor.children}
    assert supervisor.root_cause is not None and supervisor.root_cause.rank == 1
    assert outcomes[2] == "exit code 4", outcomes  # its own end, not a SIGTERM
    assert outcomes[0] == "killed by signal SIGTERM", outcomes
    assert took >= 3.0  # rank 0 had its grace
    assert "first failure on this node: rank 1" in supervisor.summary()


async def test_a_generation_ended_elsewhere_stops_the_siblings_without_the_grace(
    tmp_path,
) -> None:
    supervisor = Supervisor(_launch(tmp_path, 60.0, 90.0), out=io.StringIO(), err=io.StringIO())
    run = asyncio.ensure_future(supervisor.run())
    async with asyncio.timeout(30):
        while supervisor.root_cause is None:  # noqa: ASYNC110 (a plain attribute)
            await asyncio.sleep(0.02)
    supervisor.note_restart()  # the coordinator: the generation is over
    started = time.monotonic()
    assert await asyncio.wait_for(run, 60) == 3
    assert time.monotonic() - started < 45  # not the 60 s grace
    assert supervisor.children[0].outcome() == "killed by signal SIGTERM"
