"""Runs a node's worker processes: rank-prefixed output, signal forwarding, and a
root-cause summary when one of them fails.

Theory of operation: each child gets its own process group; its stdout and stderr are
read line by line and echoed with a ``[rankN]:`` prefix, and the last lines of stderr are
kept for the summary. The first child to exit non-zero (or the rank the coordinator names
in an abort) is the root cause. The others normally end by themselves at once (their
peers and the coordinator tell them, with an error naming it); whoever has not within
``term_timeout`` seconds is sent SIGTERM, and SIGKILL after as long again. A generation
that ended elsewhere stops the node's processes at once.

A node's rank processes are forked by its fork server (``launcher.forking``), which has
imported what a rank imports ahead, where the agent gives the supervisor one that serves;
else, and for whatever it cannot start, the supervisor starts the process itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from shardwire.worker.launcher.exits import Exited, ended_how, exited, failed_rank, process_state
from shardwire.worker.launcher.forking import Forked, ForkServer

_TAIL_LINES = 20
_STACK_LINES = 30
_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
KILL_TIMEOUT = 10.0  # seconds for a SIGKILLed process to be reaped

RankProcess = asyncio.subprocess.Process | Forked  # started by the supervisor, or forked


@dataclass
class Child:
    """One worker process and what it left behind."""

    rank: int
    local_rank: int
    proc: RankProcess
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    returncode: int | None = None
    unresponsive: bool = False  # outlived SIGTERM and was killed
    was_stopped: bool = False  # found stopped (SIGSTOP, a debugger) when the node stopped
    replaced_in: int | None = None  # live recovery: the era it replaced a dead rank in

    def outcome(self) -> str:
        code = self.returncode
        if code is None:
            return "still running"
        if self.unresponsive:
            return "unresponsive (stuck): killed after SIGTERM went unheeded"
        if self.was_stopped:
            return f"unresponsive (it was stopped, e.g. by SIGSTOP), then {self._ended()}"
        return self._ended()

    def _ended(self) -> str:
        assert self.returncode is not None
        return ended_how(self.returncode)


@dataclass(frozen=True)
class Launch:
    """What to start: ``argv`` per child and the base environment."""

    argv: list[str]
    env: dict[str, str]
    node_id: str
    node_rank: int
    nproc: int
    world_size: int
    term_timeout: float = 5.0
    leave_timeout: float = 30.0  # live recovery: the grace after a SIGTERM notice
    generation: int = 1
    # live recovery: a dead rank's process is started anew (at most this many times per
    # local rank) while its node's other processes go on; 0: a death stops the node
    respawns: int = 0


class Supervisor:
    """Starts, watches and stops one node's worker processes."""

    def __init__(
        self,
        launch: Launch,
        *,
        forks: ForkServer | None = None,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ):
        self.launch = launch
        self.forks = forks  # forks the rank processes, where it serves
        self.children: list[Child] = []
        self._out = out
        self._err = err
        self.root_cause: Child | None = None
        self.remote_abort: tuple[int, str, str] | None = None
        self.remote_stacks = ""  # where the culprits of a hang were, as the coordinator found
        self._stopping = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None  # stops the node after an abort
        self.interrupted_by = 0  # the signal the launcher received and forwarded, if any
        self.lost_coordinator = ""  # its address, when the connection to it broke mid-job
        self._spawned = False  # every child started
        self._halted = False  # the generation ended: stop (or do not start) the children
        self._respawned = [0] * launch.nproc  # by local rank (live recovery)
        self.era = 0  # live recovery: the generations this node's processes went through
        self._group: asyncio.TaskGroup | None = None  # the children's watchers

    def child_env(self, local_rank: int) -> dict[str, str]:
        la = self.launch
        rank = la.node_rank * la.nproc + local_rank
        return {
            **thread_defaults(la.env),
            **la.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": str(la.node_rank),
            "WORLD_SIZE": str(la.world_size),
            "LOCAL_WORLD_SIZE": str(la.nproc),
            "SHARDWIRE_NODE_ID": la.node_id,
            "SHARDWIRE_GENERATION": str(la.generation),
            "PYTHONUNBUFFERED": "1",
        }

    async def _spawn(self, local: int, env: dict[str, str]) -> Child:
        proc: RankProcess | None = None
        if self.forks is not None:
            proc = await self.forks.fork(env, self.launch.argv[2:])  # past the python and -u
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                *self.launch.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        return Child(self.launch.node_rank * self.launch.nproc + local, local, proc)

    async def run(self) -> int:
        """Start every child and wait until all have exited (live recovery: until none is
        started anew); returns the exit code."""
        for local in range(self.launch.nproc):
            if self._halted:
                break
            self.children.append(await self._spawn(local, self.child_env(local)))
        self._spawned = True
        if self._halted and self._reaper is None:
            self._reaper = asyncio.create_task(self.stop())
        try:
            async with asyncio.TaskGroup() as tg:
                self._group = tg
                for child in self.children:
                    tg.create_task(self._watch(child))
        finally:
            self._group = None
            if self._reaper is not None:
                self._reaper.cancel()
                await asyncio.gather(self._reaper, return_exceptions=True)
        return self._exit_code()

    async def _replace(self, child: Child) -> bool:
        """Live recovery: start a dead rank's process anew while the job goes on (its
        budget lasts, the job did not fail for good, the node is not stopping). The new
        process joins whichever generation forms next; the others re-form meanwhile."""
        local = child.local_rank
        if self._respawned[local] >= self.launch.respawns or self._over():
            return False
        self._respawned[local] += 1
        env = {**self.child_env(local), "SHARDWIRE_GENERATION": "0"}  # whichever forms
        fresh = await self._spawn(local, env)
        how = "started anew, forked" if isinstance(fresh.proc, Forked) else "started anew"
        group = self._group
        if group is None or self._over():
            # The job ended (the coordinator said so) while the process was starting:
            # nothing will ever stop it, so it goes now rather than wait for a
            # coordinator that is gone.
            await kill_group(fresh.proc)
            return False
        fresh.replaced_in = self.era
        self.children[self.children.index(child)] = fresh
        self._err.write(
            f"[agent]: rank {child.rank} {child.outcome()}; {how} (pid {fresh.proc.pid}, "
            f"{self._respawned[local]} of {self.launch.respawns}), the other ranks go on\n"
        )
        self._err.flush()
        group.create_task(self._watch(fresh))
        return True

    def _over(self) -> bool:
        """Nothing more is started on this node: the job failed for good, the coordinator
        is lost, the node is stopping or its children's watchers are done."""
        return (
            self.remote_abort is not None
            or bool(self.lost_coordinator)
            or self._stopping.is_set()
            or self._group is None
        )

    async def _watch(self, child: Child) -> None:
        assert child.proc.stdout is not None and child.proc.stderr is not None
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump(child, child.proc.stdout, self._out, keep=False))
            tg.create_task(self._pump(child, child.proc.stderr, self._err, keep=True))
        child.returncode = await child.proc.wait()
        if child.returncode != 0 and self.launch.respawns and await self._replace(child):
            return
        # The first to fail is the root cause. The others learn of it from their peers and
        # the coordinator at once and end with an error naming it; whoever does not (busy
        # outside a collective) is stopped after the grace, as after an abort.
        if child.returncode != 0 and self.root_cause is None and not self._stopping.is_set():
            self.root_cause = child
            self._stop_after_grace()

    async def _pump(
        self, child: Child, stream: asyncio.StreamReader, sink: TextIO, *, keep: bool
    ) -> None:
        # Lines end in "\n", progress-bar redraws in "\r": both start a new prefixed
        # segment, and "\r" passes through so a terminal redraws the bar in place.
        prefix = f"[rank{child.rank}]: "
        pending = ""
        while chunk := await stream.read(65536):
            pending += chunk.decode(errors="replace")
            *done, pending = re.split(r"(?<=[\r\n])", pending)
            for segment in done:
                text = segment.rstrip("\r\n")
                if keep and segment.endswith("\n"):
                    child.tail.append(text)
                if text or segment == "\n":
                    sink.write(prefix + text + segment[len(text) :])
                else:  # a bare "\r" before a redraw: no empty tagged line
                    sink.write(segment)
            sink.flush()
        if pending:
            if keep:
                child.tail.append(pending)
            sink.write(prefix + pending + "\n")
            sink.flush()

    def pids(self) -> list[int]:
        """The process ids of the children still running (each leads its own group)."""
        return [c.proc.pid for c in self.children if c.proc.returncode is None]

    def signal_all(self, sig: int) -> None:
        for child in self.children:
            if child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, sig)

    async def stop(self, sig: int = signal.SIGTERM, *, grace: float | None = None) -> None:
        """Signal every running child, then SIGKILL whoever outlives ``grace`` seconds
        (``term_timeout`` unless given)."""
        self._stopping.set()
        for child in self.children:
            child.was_stopped = child.proc.returncode is None and _is_stopped(child.proc.pid)
        self.signal_all(sig)
        self.signal_all(signal.SIGCONT)  # a stopped child acts on the signal only once continued
        running = [c.proc.wait() for c in self.children if c.proc.returncode is None]
        try:
            async with asyncio.timeout(self.launch.term_timeout if grace is None else grace):
                await asyncio.gather(*running)
        except TimeoutError:
            for child in self.children:
                child.unresponsive = child.proc.returncode is None
            self.signal_all(signal.SIGKILL)

    def _exit_code(self) -> int:
        codes = [c.returncode or 0 for c in self.children]
        if all(code == 0 for code in codes):
            return 0
        if self.root_cause is not None and self.root_cause.returncode:
            code = self.root_cause.returncode
            return 128 - code if code < 0 else code
        return 1

    def summary(self, extra: list[str] | None = None) -> str:
        """The root-cause report printed when the node's job did not succeed, with
        ``extra`` lines (the generations) at its end."""
        title = "shardwire: job failed"
        if self.interrupted_by:
            title = f"shardwire: job stopped by {signal.Signals(self.interrupted_by).name}"
        lines = ["=" * 72, title, "-" * 72]
        if self.lost_coordinator:
            lines.append(f"root cause: lost the coordinator at {self.lost_coordinator}")
        elif self.remote_abort is not None:
            rank, reason, _tb = self.remote_abort
            lines.append(f"root cause (from the coordinator): rank {rank}: {reason}")
            if self.remote_stacks:
                lines.append("where the ranks that did not arrive were:")
                lines += [
                    f"  {t}" for t in self.remote_stacks.rstrip().splitlines()[-_STACK_LINES:]
                ]
        cause = self.root_cause
        if cause is not None:
            lines.append(
                f"first failure on this node: rank {cause.rank} (local rank "
                f"{cause.local_rank}) on host {self.launch.node_id}: {cause.outcome()}"
            )
            if cause.tail:
                lines.append("last lines of its stderr:")
                lines += [f"  {t}" for t in list(cause.tail)[-12:]]
        others = [c for c in self.children if c is not cause]
        if others:
            lines.append("other ranks on this node:")
            lines += [f"  rank {c.rank}: {c.outcome()}" for c in others]
        lines += extra or []
        lines.append("=" * 72)
        return "\n".join(lines)

    def note_abort(self, rank: int, reason: str, traceback: str, stacks: str = "") -> None:
        """The coordinator named the failed rank; it is the root cause if it is ours."""
        if self.remote_abort is None:
            self.remote_abort = (rank, reason, traceback)
            self.remote_stacks = stacks
        local = [c for c in self.children if c.rank == rank]
        if local:
            self.root_cause = local[0]
        # The job is over. Ranks normally exit by themselves at their next collective;
        # one stuck elsewhere (the rank a hang inquest named, say) is stopped.
        self._stop_after_grace()

    def note_restart(self, rank: int = -1) -> None:
        """The generation ended elsewhere: stop this node's processes now (SIGTERM, then
        SIGKILL after the grace period) so the next generation can start. With live
        recovery they go on and re-form; only ``rank``, the one that failed, is killed if
        it is this node's and its process of the ended generation still runs (a hang): it
        is then started anew. A process that already replaced it is left alone; one that
        died but is not reaped yet is said to have died, and is replaced once reaped. A
        node told to stop (its agent got SIGTERM or SIGINT) starts no rank anew: its ranks,
        the one named too (it left on the notice, say), end within the grace they got."""
        if self.launch.respawns:
            if self.interrupted_by:
                return
            for child in self.children:
                ended = child.replaced_in != self.era  # it ran in the ended generation
                if child.rank == rank and child.proc.returncode is None and ended:
                    line, kill = failed_rank(rank, _ended(child.proc))
                    self._err.write(f"[agent]: {line}\n")
                    self._err.flush()
                    if kill:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(child.proc.pid, signal.SIGKILL)
            return
        self._halted = True
        if self._spawned and not self._stopping.is_set():
            if self._reaper is not None:  # still granting the ranks their own end: over
                self._reaper.cancel()
            self._reaper = asyncio.create_task(self.stop())

    def note_lost_coordinator(self, address: str) -> None:
        """The coordinator went away while the job ran: that is the root cause."""
        if self.remote_abort is None and not self.lost_coordinator:
            self.lost_coordinator = address
            self._stop_after_grace()

    def _stop_after_grace(self) -> None:
        """Stop whoever of the children has not ended within ``term_timeout`` (once)."""
        if self._reaper is None and self.children:
            self._reaper = asyncio.create_task(self._stop_after(self.launch.term_timeout))

    async def _stop_after(self, grace: float) -> None:
        running = [c.proc.wait() for c in self.children if c.proc.returncode is None]
        try:
            async with asyncio.timeout(grace):
                await asyncio.gather(*running)
        except TimeoutError:
            if not self._stopping.is_set():
                await self.stop()


def _is_stopped(pid: int) -> bool:
    """Whether a process is stopped (False where there is no /proc)."""
    return process_state(pid) in ("T", "t")


def thread_defaults(env: dict[str, str]) -> dict[str, str]:
    """Like torchrun: one BLAS/OpenMP thread per process unless ``env`` says otherwise,
    so N processes on N cores do not fight N*N spinning threads."""
    return {k: "1" for k in _THREAD_VARS if k not in env}


def _ended(proc: RankProcess) -> Exited | None:
    """How a rank's process ended, told before its end is reaped; None while it runs."""
    return proc.exited() if isinstance(proc, Forked) else exited(proc.pid)


async def kill_group(proc: RankProcess) -> None:
    """SIGKILL a process's group (a replacement the job no longer wants) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(KILL_TIMEOUT):
            await proc.wait()
