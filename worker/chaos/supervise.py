"""Faults a launcher injects into processes it started: the coordinator, or a node.

``shardwire launch --standalone`` (and the first node of a scheduler's job) runs the
job's coordinator as its child. With a plan that has faults on the coordinator
(``rank = "coordinator"``, at ``after_s``), the launcher signals that child itself: a
coordinator is a separate program that knows nothing of plans. A fault on a node
(``node = N``, at ``after_s`` after the node's agent was placed) is injected by that
node's agent into itself and every rank it started, at once: a machine lost, frozen
or shut down. Each injection is noted in the chaos log, like the ranks' own (``rank``
-1 for the coordinator, -2 for a node, with the node and its ranks), and fires once
per job. So is the coordinator's return (``back``): when the launcher started it again
after a signal killed it, or continued it after a stop, for the verdict to say how long
the job was without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from shardwire.worker.chaos import PLAN_VARIABLE
from shardwire.worker.chaos.faultlog import (
    CLEAN_VARIABLE,
    LOG_VARIABLE,
    fired_faults,
    resume_later,
)
from shardwire.worker.chaos.plan import COORDINATOR, NODE, Fault, Plan, Scheduled, load

_SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}


def coordinator_faults(
    environ: Mapping[str, str], pid: Callable[[], int]
) -> asyncio.Task[None] | None:
    """A task that injects the plan's coordinator faults into the process ``pid()`` names
    at the time (a killed coordinator may be started again; the caller owns the task and
    cancels it when the job ends); None without any."""
    pending = _pending(environ, lambda plan: plan.on_coordinator())
    return None if pending is None else asyncio.ensure_future(_on_coordinator(*pending, pid))


def node_faults(
    environ: Mapping[str, str], node: int, ranks: list[int], pids: Callable[[], list[int]]
) -> asyncio.Task[None] | None:
    """A task that injects the plan's faults on node ``node`` (its ``ranks``) into this
    agent and the processes ``pids()`` names at the time, each the leader of its own
    process group (the caller owns the task); None without any."""
    pending = _pending(environ, lambda plan: plan.on_node(node))
    if pending is None:
        return None
    return asyncio.ensure_future(_on_node(*pending, {"node": node, "ranks": ranks}, pids))


def _pending(
    environ: Mapping[str, str], pick: Callable[[Plan], list[Scheduled]]
) -> tuple[list[Scheduled], Path] | None:
    """The faults ``pick`` takes from the plan that have not fired yet, with the chaos
    log; None without a plan, in a clean run (checks, no faults), or without any."""
    path = environ.get(PLAN_VARIABLE)
    if not path or environ.get(CLEAN_VARIABLE) == "1":
        return None
    log = Path(environ.get(LOG_VARIABLE) or f"{path}.log")
    fired = fired_faults(log)
    faults = [s for s in pick(load(path)) if (s.index, 0) not in fired]
    return (faults, log) if faults else None


def note_coordinator_back(environ: Mapping[str, str], pid: int, how: str) -> None:
    """Note in the chaos log that the coordinator (process ``pid``) is back (``how``:
    started again, continued); nothing without a plan, or in a clean run."""
    path = environ.get(PLAN_VARIABLE)
    if not path or environ.get(CLEAN_VARIABLE) == "1":
        return
    log = Path(environ.get(LOG_VARIABLE) or f"{path}.log")
    _note(log, {"rank": COORDINATOR, "event": "back", "how": how, "pid": pid})


def _note(log: Path, entry: dict[str, Any]) -> None:
    with log.open("a") as out:  # one write: lines of the ranks do not interleave
        out.write(json.dumps({"t": time.time(), **entry}) + "\n")


async def _due(faults: list[Scheduled], log: Path, who: dict[str, Any]) -> AsyncIterator[Fault]:
    """Each fault at its time (``after_s`` from now), once noted in the chaos log as
    injected on ``who``."""
    started = time.monotonic()
    for scheduled in sorted(faults, key=lambda s: s.fault.after_s or 0.0):
        fault = scheduled.fault
        await asyncio.sleep(max(0.0, (fault.after_s or 0.0) - (time.monotonic() - started)))
        entry = {**who, "event": "injected", "fault": scheduled.index, "kind": fault.kind}
        _note(log, {**entry, "step": None})
        yield fault


async def _on_node(
    faults: list[Scheduled],
    log: Path,
    where: dict[str, Any],
    pids: Callable[[], list[int]],
) -> None:
    async for fault in _due(faults, log, {"rank": NODE, **where}):
        groups = [-pid for pid in pids()]  # each rank's whole process group
        if fault.kind == "term":  # a node shut down: its agent stops its ranks as it would
            os.kill(os.getpid(), signal.SIGTERM)
            continue
        if fault.kind == "stop":
            resume_later(fault.for_s, [os.getpid(), *groups])
        for target in groups:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, _SIGNALS[fault.kind])
        os.kill(os.getpid(), _SIGNALS[fault.kind])  # the agent last: it is the one acting


async def _on_coordinator(faults: list[Scheduled], log: Path, pid: Callable[[], int]) -> None:
    async for fault in _due(faults, log, {"rank": COORDINATOR}):
        target = pid()
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, _SIGNALS[fault.kind])
            if fault.kind == "stop":
                await asyncio.sleep(fault.for_s)
                os.kill(target, signal.SIGCONT)
                back = {"rank": COORDINATOR, "event": "back", "how": "continued"}
                _note(log, {**back, "pid": target})
