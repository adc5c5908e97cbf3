"""A group's way into its node arena: opened on first use, calls handed over in order.

Calls are queued with the arena when they are *made* (not when awaited), so the arena
runs them in the group's call order however the caller awaits them. Calls made while
the arena is being opened wait in the gate; when it opens they are handed over in
order, and if it cannot open each of them runs on the group's links instead.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from shardwire.protocol import ShardwireError
from shardwire.worker.arena.engine import Job
from shardwire.worker.arena.node import NodeArena
from shardwire.worker.arena.programs import Context, Program
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.opening import open_arena
from shardwire.worker.observe.split import Split
from shardwire.worker.transport.arena_settings import ArenaSettings
from shardwire.worker.transport.traffic import TransportStats

# The engine's own deadline trails the group's, which cancels the call first and names
# the silent ranks; the engine's only stops a thread nobody waits for any more.
_BACKSTOP = 1.0


def _deadline(limit: float) -> float:
    """The engine's deadline for a call of time limit ``limit`` (monotonic seconds)."""
    return time.monotonic() + limit + _BACKSTOP if limit != math.inf else math.inf


class GateState(enum.Enum):
    CLOSED = "closed"  # no call has asked for the arena yet
    OPENING = "opening"  # the first call's exchange is under way
    OPEN = "open"  # calls run on the arena
    UNAVAILABLE = "unavailable"  # the region could not be made or attached: TCP
    FAILED = "failed"  # opening raised (a peer failed meanwhile): the group is poisoned


class Ticket:
    """One call's place in the arena's order."""

    __slots__ = ("background", "build", "deadline", "job", "seq", "signature", "split")

    def __init__(
        self,
        build: Callable[[Context], Program],
        seq: int,
        signature: str,
        limit: float,
        split: Split | None = None,
    ):
        self.build = build
        self.seq = seq
        self.signature = signature
        self.split = split
        self.deadline = _deadline(limit)
        self.job: Job | None = None
        self.background = False  # started, not awaited: the engine's thread runs it


class Gate:
    """Opens the arena of a group's ranks (all on this node) and feeds it calls."""

    def __init__(
        self,
        settings: ArenaSettings,
        spawn: Callable[[Coroutine[Any, Any, None]], Any],
        what: str,
        stats: TransportStats,
    ) -> None:
        self.settings = settings
        self._stats = stats  # the transport's TransportStats: arena bytes count there too
        self.state = GateState.CLOSED
        self.arena: NodeArena | None = None
        self._spawn = spawn
        self._what = what
        self._pending: list[Ticket] = []
        self._opening: Any = None  # the Work of the opening exchange
        self._failure: BaseException | None = None  # why opening failed

    def enqueue(self, call: Call, build: Callable[[Context], Program], limit: float) -> Ticket:
        """Place ``call`` (just made) in the arena's order."""
        ticket = Ticket(build, call.seq, call.signature, limit, call.split)
        if self.state is GateState.OPEN:
            assert self.arena is not None
            ticket.job = self.arena.submit(
                build, ticket.seq, ticket.signature, ticket.deadline, ticket.split
            )
        elif self.state in (GateState.CLOSED, GateState.OPENING):
            self._pending.append(ticket)
            if self.state is GateState.CLOSED:
                self.state = GateState.OPENING
                self._opening = self._spawn(self._open(call))
        return ticket

    def express(
        self,
        seq: int,
        signature: str,
        build: Callable[[Context], Program],
        limit: float,
        split: Split | None = None,
    ) -> Ticket | bool:
        """Run call ``seq`` at once, on the loop, if the arena is open and idle. True: a
        small call whose peers were there ran to its end before this returned, with no
        task, future or thread hop. A ticket: it started, and ``run`` waits for the rest
        (or raises its error). False if the arena is not open or busy: nothing was done,
        and the call takes its place with :meth:`enqueue`."""
        arena = self.arena
        if self.state is not GateState.OPEN or arena is None:
            return False
        job = arena.express(build, seq, signature, _deadline(limit), split)
        if job is None:
            return False
        if job.finished:
            arena.count(self._stats)
            if job.error is None:
                return True
        ticket = Ticket(build, seq, signature, limit, split)
        ticket.job = job
        return ticket

    def waiting(self, ticket: Ticket) -> list[int]:
        """The global ranks the call of ``ticket`` waits for in the arena now (and those
        that have not made it yet); empty once it ended."""
        arena, job = self.arena, ticket.job
        if arena is None or job is None or job.finished:
            return []
        late = set(arena.engine.lagging(job)) | set(arena.board.absent(ticket.seq))
        return [arena.ranks[r] for r in sorted(late)]

    def relayed(self, ticket: Ticket) -> BaseException | None:
        """The error another local rank ended the call of ``ticket`` with, if it did."""
        arena, job = self.arena, ticket.job
        return None if arena is None or job is None else arena.relayed(job)

    def hurry(self, ticket: Ticket) -> None:
        """The call was started in the background: the arena's thread runs it now (or as
        soon as the arena is open), overlapping the loop's compute."""
        ticket.background = True
        if ticket.job is not None and self.arena is not None:
            self.arena.engine.hurry()

    async def run(self, ticket: Ticket, silent: list[int]) -> bool:
        """Run the call on the arena; False if the group has none (use TCP)."""
        if ticket.job is None and self.state is GateState.OPENING:
            await self._opening.wait()
        if ticket.job is None:
            if self.state is GateState.FAILED:
                raise self._failure or RuntimeError(f"{self._what}: the arena is closed")
            return False
        assert self.arena is not None
        try:
            await self.arena.run(ticket.job, silent, ticket.seq, ticket.signature)
        finally:
            if self.arena is not None:
                self.arena.count(self._stats)
        return True

    async def _open(self, call: Call) -> None:
        try:
            arena = await open_arena(call, self.settings, self._what)
        except BaseException as exc:  # kept for the calls that wait: nobody may await this
            self.state = GateState.FAILED
            self._pending.clear()
            if isinstance(exc, asyncio.CancelledError):
                self._failure = ShardwireError(f"{self._what}: opening the arena was cancelled")
                raise
            self._failure = exc
            return
        self.arena = arena
        self.state = GateState.OPEN if arena is not None else GateState.UNAVAILABLE
        for ticket in self._pending:
            if arena is not None:
                ticket.job = arena.submit(
                    ticket.build, ticket.seq, ticket.signature, ticket.deadline, ticket.split
                )
        if arena is not None and any(t.background for t in self._pending):
            arena.engine.hurry()
        self._pending.clear()

    def poison(self, error: BaseException) -> None:
        if self.arena is not None:
            self.arena.poison(error)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.state = GateState.FAILED
