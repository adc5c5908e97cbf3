"""Faults the launcher injects into a process it started: the coordinator.

``shardwire launch --standalone`` (and the first node of a scheduler's job) runs the
job's coordinator as its child. With a plan that has faults on the coordinator
(``rank = "coordinator"``, at ``after_s``), the launcher signals that child itself: a
coordinator is a separate program that knows nothing of plans. Each injection is noted
in the chaos log, like the ranks' own (``rank`` -1), and fires once per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from shardwire.worker.chaos.inject import LOG_VARIABLE, PLAN_VARIABLE, fired_faults
from shardwire.worker.chaos.plan import COORDINATOR, Scheduled, load

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


def coordinator_faults(
    environ: Mapping[str, str], pid: Callable[[], int]
) -> asyncio.Task[None] | None:
    """A task that injects the plan's coordinator faults into the process ``pid()`` names
    at the time (a killed coordinator may be started again; the caller owns the task and
    cancels it when the job ends); None without any."""
    path = environ.get(PLAN_VARIABLE)
    if not path:
        return None
    log = Path(environ.get(LOG_VARIABLE) or f"{path}.log")
    fired = fired_faults(log)
    faults = [s for s in load(path).on_coordinator() if (s.index, 0) not in fired]
    if not faults:
        return None
    return asyncio.ensure_future(_inject(faults, pid, log))


async def _inject(faults: list[Scheduled], pid: Callable[[], int], log: Path) -> None:
    started = time.monotonic()
    for scheduled in sorted(faults, key=lambda s: s.fault.after_s or 0.0):
        fault = scheduled.fault
        await asyncio.sleep(max(0.0, (fault.after_s or 0.0) - (time.monotonic() - started)))
        entry = {"rank": COORDINATOR, "t": time.time(), "event": "injected"}
        entry.update(fault=scheduled.index, kind=fault.kind, step=None)
        with log.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        target = pid()
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, _SIGNALS[fault.kind])
            if fault.kind == "stop":
                await asyncio.sleep(fault.for_s)
                os.kill(target, signal.SIGCONT)
