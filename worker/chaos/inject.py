"""Injecting a plan's faults into this rank, from inside its own process.

Only :func:`from_environment` installs an injector, and only when the person who started
the job gave a plan (``shardwire chaos PLAN -- ...`` sets ``SHARDWIRE_CHAOS`` to the
plan's path for the processes it starts). Without it nothing here runs: no wrapper, no
task, no check on any path.

A fault at a step fires when this rank finishes that step (``pg.step_finished``, which
the run log calls every step and ``pg.report_progress`` calls too), or the first step
reported after it; a fault at a collective fires as the rank's world group places that
call (``pg.watch_calls``, installed only for a plan with such a fault); a fault at a
time fires that long after the rank joined, from a task the injector owns.
A ``raise`` at a step raises out of ``report_progress``; at a time or a collective, it
poisons the rank's transport, so its collectives raise it.
Every ``check_every`` steps, where the script handed the run log what it read and what
it holds, the rank notes a fingerprint of each (and the loss) for the verdict's
invariant checks.
Before acting, the injector appends what it does to the chaos log (one JSON line:
fault, rank, step, time), and marks it on the timeline when the job is traced. The
log also gets one line when the rank's session ends, with how it ended: that is how
``shardwire chaos`` learns who detected a fault, when, and what they named; and one
when the rank lost its connection to the coordinator, and one when it reconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from shardwire.protocol import ShardwireError
from shardwire.protocol.errors import blamed_rank
from shardwire.worker.chaos import PLAN_VARIABLE
from shardwire.worker.chaos.faultlog import (
    CLEAN_VARIABLE,
    LOG_VARIABLE,
    fired_in,
    read_log,
    resume_later,
)
from shardwire.worker.chaos.links import LinkFaults
from shardwire.worker.chaos.plan import NETWORK, Plan, Scheduled, load
from shardwire.worker.collectives.process import ProcessGroup, StepState
from shardwire.worker.fsdp.store import SlowDisk
from shardwire.worker.observe import trace
from shardwire.worker.transport.base import Transport
from shardwire.worker.transport.mesh import TcpMesh
from shardwire.worker.transport.shmfiles import SHM_DIR, new_name


class InjectedFault(ShardwireError):
    """A ``raise`` fault of a chaos plan, raised on purpose in this rank."""


class Injector:
    """This rank's faults of a plan, fired by step or by time."""

    def __init__(self, plan: Plan, group: ProcessGroup, log: Path, *, clean: bool = False) -> None:
        self.group = group
        self.rank = group.rank
        self.log = log
        self.started = time.time()
        self.check_every = plan.check_every
        entries = read_log(log)
        fired = fired_in(entries)  # a restarted job does not get a fault twice
        # every_s faults count from the job's start: the first rank that ever joined
        self.epoch = min(
            (e["t"] for e in entries if e.get("event") == "joined"), default=self.started
        )
        self.last_step: int | None = None
        mine = [
            s
            for s in ([] if clean else plan.schedule(group.world_size))  # clean: checks only
            if s.rank == self.rank and (s.index, s.occurrence) not in fired
        ]
        # an every_s occurrence due while the job was down (restarting) hits nothing
        mine = [s for s in mine if s.at_s is None or self.epoch + s.at_s > self.started]
        self.links = None
        if any(s.fault.kind in NETWORK for s in mine):  # only then: nothing before send
            self.links = LinkFaults(group.transport, plan.seed)
        self.by_step = sorted(
            (s for s in mine if s.fault.step is not None), key=lambda s: s.fault.step or 0
        )
        self.by_call = sorted(
            (s for s in mine if s.fault.collective is not None),
            key=lambda s: s.fault.collective or 0,
        )
        if self.by_call:  # only then: the other ranks' calls go as they always do
            group.watch_calls(self._called)
        self._tasks = [
            asyncio.ensure_future(self._at(s))
            for s in mine
            if s.fault.after_s is not None or s.at_s is not None
        ]
        group.watch_steps(self._stepped)
        group.watch_summaries(lambda p: self.note({"event": "summary", "path": str(p.absolute())}))
        joined = {"world": group.world_size, "generation": group.generation, "pid": os.getpid()}
        self.note({"event": "joined", **joined})
        _note_termination(self)

    def _stepped(self, step: int, state: StepState | None) -> None:
        if self.last_step is None:  # this process's first step: when the job got going again
            self.note({"event": "stepped", "step": step, "generation": self.group.generation})
        self.last_step = step
        if state is not None and self.check_every and step % self.check_every == 0:
            self.note(
                {
                    "event": "state",
                    "step": step,
                    **_fingerprints(state),
                    "generation": self.group.generation,
                    "pid": os.getpid(),
                }
            )
        while self.by_step and (self.by_step[0].fault.step or 0) <= step:
            self.fire(self.by_step.pop(0), step)  # a step passed unreported still counts

    def _called(self, seq: int, op: str) -> None:
        while self.by_call and (self.by_call[0].fault.collective or 0) <= seq:
            self.fire(self.by_call.pop(0), self.last_step, call=(seq, op))

    async def _at(self, scheduled: Scheduled) -> None:
        if scheduled.at_s is not None:  # from the job's start
            await asyncio.sleep(max(0.0, self.epoch + scheduled.at_s - time.time()))
        else:
            await asyncio.sleep(scheduled.fault.after_s or 0.0)
        self.fire(scheduled, self.last_step)

    def fire(
        self, scheduled: Scheduled, step: int | None, *, call: tuple[int, str] | None = None
    ) -> None:
        fault = scheduled.fault
        entry = {"event": "injected", "fault": scheduled.index, "kind": fault.kind, "step": step}
        if call is not None:  # in which collective: its sequence number and op
            entry.update(collective=call[0], op=call[1])
        self.note({**entry, "occurrence": scheduled.occurrence})
        tracer = trace.current()
        if tracer is not None:
            now = time.monotonic()
            args = {"fault": scheduled.index, "kind": fault.kind}
            tracer.add(f"fault: {fault.kind}", "chaos", now, now, args)
        if fault.kind in NETWORK:
            assert self.links is not None
            self.links.start(fault)
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "stop":
            resume_later(fault.for_s, [os.getpid()])
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "block":
            time.sleep(fault.for_s)  # on the event loop's thread, on purpose
        elif fault.kind == "nofile":
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (fault.limit, hard))
        elif fault.kind == "shm_fill":
            fill_shm(self.group.transport, fault.percent)
        elif fault.kind == "slow_disk":
            SlowDisk.delay_s, SlowDisk.until = fault.delay_s, time.monotonic() + fault.for_s
        else:
            error = InjectedFault(f"fault {scheduled.index} of the chaos plan ({fault.kind})")
            if step is not None and call is None:
                raise error  # out of report_progress, into the script
            self.group.transport.abort(error)  # its collectives raise it from now on

    def note(self, entry: dict[str, Any]) -> None:
        """Append ``entry`` (with this rank and the time) to the chaos log."""
        line = json.dumps({"rank": self.rank, "t": time.time(), **entry}) + "\n"
        with self.log.open("a") as out:  # one write: lines of the ranks do not interleave
            out.write(line)

    def noticed(self, error: BaseException) -> None:
        """This rank learned that the job failed (any thread): the error goes to the log,
        before anything may stop the process."""
        self.note({"event": "noticed", **_described(error)})

    def coordinator(self, *, away: bool, at: float) -> None:
        """This rank lost its connection to the coordinator (``away``) and waits for its
        return, or the coordinator took it back; ``at``: when (wall clock)."""
        self.note({"event": "lost_coordinator" if away else "rejoined", "t": at})

    def close(self) -> None:
        """The rank re-forms: this generation's timed faults are dropped (the injector of
        the next one picks up whatever has not fired)."""
        for task in self._tasks:
            task.cancel()

    def ended(self, error: BaseException | None) -> None:
        """The rank's session is over: how it ended goes to the log."""
        for task in self._tasks:
            task.cancel()
        if error is None:
            self.note({"event": "ended", "outcome": "ok"})
        else:
            self.note({"event": "ended", **_described(error)})


def _note_termination(injector: Injector) -> None:
    """A SIGTERM (the node agent stopping this rank because a sibling died, or a launcher
    passing one on) goes to the chaos log before it ends the process as it would have:
    being stopped is how this rank learned of the failure."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread

    def on_term(signum: int, _frame: object) -> None:
        injector.note({"event": "ended", "outcome": "SIGTERM", "message": "stopped by SIGTERM"})
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, on_term)


def _fingerprints(state: StepState) -> dict[str, Any]:
    """xxh3 digests of what the rank read and holds after a step, with the loss."""
    out: dict[str, Any] = {}
    if state.read is not None:
        out["read"] = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(state.read).data)
    if state.held is not None:
        key, arrays = state.held()
        digest = xxhash.xxh3_64()
        for array in arrays:
            digest.update(np.ascontiguousarray(array).data)
        out.update(key=key, digest=digest.hexdigest())
    if state.loss is not None:
        out["loss"] = state.loss
    return out


def _described(error: BaseException) -> dict[str, Any]:
    """The error's kind, its first line and, where another rank's news brought it here,
    the rank it began on (``blamed``: a relayed error's message need not name it)."""
    message = str(error).splitlines()[0] if str(error) else ""
    described: dict[str, Any] = {"outcome": type(error).__name__, "message": message[:500]}
    if (blamed := blamed_rank(error)) >= 0:
        described["blamed"] = blamed
    return described


def fill_shm(transport: Transport, percent: float, directory: Path = SHM_DIR) -> int:
    """Fill ``directory`` to ``percent`` % with a file named for the run (the node agent
    removes the run's files when the job ends); returns the bytes taken."""
    run_id = transport.config.run_id if isinstance(transport, TcpMesh) else "shardwire"
    stats = os.statvfs(directory)
    total, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    wanted = int(total * percent / 100) - (total - free)
    if wanted <= 0:
        return 0
    path = directory / new_name(run_id)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with contextlib.suppress(OSError):  # a full directory: as full as it would go
            os.posix_fallocate(fd, 0, wanted)
    finally:
        os.close(fd)
    return wanted


def from_environment(environ: Mapping[str, str], group: ProcessGroup) -> Injector | None:
    """The injector of the plan this process was started with; None without one."""
    path = environ.get(PLAN_VARIABLE)
    if not path:
        return None
    log = Path(environ.get(LOG_VARIABLE) or f"{path}.log")
    with contextlib.suppress(OSError):
        log.parent.mkdir(parents=True, exist_ok=True)
    return Injector(load(path), group, log, clean=environ.get(CLEAN_VARIABLE) == "1")
