"""What one node agent hears about the job, generation after generation.

The coordinator ends each generation with a verdict: ``Finished`` (every rank is done),
``Restart`` (the next generation is forming), ``Abort`` (the job failed for good), or
silence when the connection to it is lost. :class:`JobWatch` keeps the verdict of the
running generation, passes it on to that generation's :class:`Supervisor`, and builds
the final report with the generation history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from shardwire.protocol.history import describe
from shardwire.protocol.messages import Abort, Finished, GenerationInfo, NodeAssignment, Restart
from shardwire.worker.launcher.forking import ForkServer
from shardwire.worker.launcher.supervisor import Launch, Supervisor

Verdict = Abort | Restart | Finished


class JobWatch:
    """The verdicts and history of a job as one node agent sees them."""

    def __init__(self, coordinator: str, *, clock: Callable[[], float] = time.monotonic):
        self.coordinator = coordinator  # its address, for "lost the coordinator"
        self._clock = clock
        self.supervisor: Supervisor | None = None
        self.assignment: NodeAssignment | None = None
        self._assigned_at = 0.0  # the assignment's history ages count from then
        self._ended_at: float | None = None
        self.verdict: Verdict | None = None
        self.lost = False
        self._heard = asyncio.Event()

    def begin(
        self, assignment: NodeAssignment, launch: Launch, forks: ForkServer | None = None
    ) -> Supervisor:
        """A generation starts on this node: a fresh supervisor (its rank processes forked
        by ``forks`` where it serves), no verdict yet."""
        self.assignment = assignment
        self._assigned_at = self._clock()
        self._ended_at = None
        self.verdict = None
        self._heard = asyncio.Event()
        self.supervisor = Supervisor(launch, forks=forks)
        return self.supervisor

    def _decide(self, verdict: Verdict | None) -> None:
        if self._heard.is_set():
            return
        self.verdict = verdict
        self.lost = verdict is None
        self._ended_at = self._clock()
        self._heard.set()

    def on_abort(self, msg: Abort | None) -> None:
        """The job failed (an ``Abort``), or the coordinator is gone (``None``)."""
        if self._heard.is_set() and msg is None:
            return  # the connection closing after a verdict is no news
        sup = self.supervisor
        if sup is not None:
            if msg is None:
                sup.note_lost_coordinator(self.coordinator)
            else:
                sup.note_abort(msg.rank, msg.reason, msg.traceback, msg.stacks)
        self._decide(msg)

    def on_generation(self, msg: Restart | Finished) -> None:
        """``Restart``: stop this node's processes now. ``Finished``: the job is done."""
        if isinstance(msg, Restart) and self.supervisor is not None:
            self.supervisor.note_restart(msg.rank)
        self._decide(msg)

    def renew(self, assignment: NodeAssignment) -> None:
        """Live recovery: the next generation formed around this node's running processes
        (the same supervisor goes on); no verdict on it yet."""
        self.assignment = assignment
        self._assigned_at = self._clock()
        self._ended_at = None
        self.verdict = None
        self.lost = False
        self._heard = asyncio.Event()
        if self.supervisor is not None:
            self.supervisor.era += 1

    async def heard(self) -> None:
        """Until the running generation's verdict is in."""
        await self._heard.wait()

    def may_restart(self, *, elastic: bool) -> bool:
        """Whether a verdict can still be a restart (else the node's result is final)."""
        a = self.assignment
        return a is not None and (elastic or a.restarts < a.max_restarts)

    async def restarting(self, timeout: float) -> bool:
        """Wait (bounded) for the verdict on the generation; True for a restart."""
        try:
            async with asyncio.timeout(timeout):
                await self._heard.wait()
        except TimeoutError:
            return False
        return isinstance(self.verdict, Restart)

    def restart_line(self) -> str:
        msg, a = self.verdict, self.assignment
        assert isinstance(msg, Restart) and a is not None
        budget = f"restart {msg.restarts} of {msg.max_restarts}"
        return (
            f"generation {a.generation} ended ({msg.reason}); starting generation "
            f"{msg.generation} ({budget})"
        )

    def exit_code(self, local: int) -> int:
        """The node's exit status: its processes', or 1 if the job failed elsewhere."""
        if local == 0 and (isinstance(self.verdict, Abort) or self.lost):
            return 1
        return local

    def history(self) -> list[GenerationInfo]:
        """Every generation so far, ages as of now."""
        a = self.assignment
        if a is None:
            return []
        now = self._clock()
        since = now - self._assigned_at
        past = [g.model_copy(update={"started_age_s": g.started_age_s + since}) for g in a.history]
        ended = self._ended_at
        current = GenerationInfo(
            generation=a.generation,
            world_size=a.world_size,
            nodes=a.nnodes,
            started_age_s=since,
            duration_s=None if ended is None else ended - self._assigned_at,
            ended_by=self._cause(),
        )
        return [*past, current]

    def _cause(self) -> str:
        msg = self.verdict
        if isinstance(msg, Finished):
            return "finished"
        if isinstance(msg, Restart):
            return msg.reason
        if isinstance(msg, Abort):
            return f"rank {msg.rank} failed: {msg.reason}"
        return f"lost the coordinator at {self.coordinator}" if self.lost else ""

    def report(self, code: int) -> str:
        """The final summary: the root cause on failure, and every generation when there
        was more than one (empty for a plain successful run)."""
        history = self.history()
        lines = [f"  {line}" for line in describe(history)]
        if code != 0 and self.supervisor is not None:
            return self.supervisor.summary(["generations:", *lines])
        if len(history) <= 1:
            return ""
        restarts = self.assignment.restarts if self.assignment else 0
        title = f"shardwire: job finished after {len(history)} generations ({restarts} restarts)"
        return "\n".join(["=" * 72, title, "-" * 72, *lines, "=" * 72])
