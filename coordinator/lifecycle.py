"""The job across generations: forming one, ending one, restarting (pure).

:class:`Lifecycle` holds the rendezvous's state and the transitions between
generations; :class:`~shardwire.coordinator.rendezvous.Rendezvous` adds the handlers of
joins, liveness and failures on top. Ending a generation (a failure with restarts left,
or a membership change) aborts its workers, tells the agents to ``Restart``, and waits
until every agent has rejoined and every old worker connection has closed before the
next generation forms: no rank of g+1 starts while a process of g is alive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardwire.coordinator.diagnosis import Inquest
from shardwire.coordinator.forming import assignments
from shardwire.coordinator.generations import Generations
from shardwire.coordinator.linktable import LinkTable
from shardwire.coordinator.membership import JoinIndex, Shape
from shardwire.coordinator.progress import Curves
from shardwire.coordinator.state import (
    Action,
    Agent,
    ConnId,
    FailureRecord,
    JobState,
    RankState,
    RendezvousConfig,
    Send,
    Worker,
)
from shardwire.coordinator.stragglers import Stragglers
from shardwire.protocol.messages import Abort, Join, Restart
from shardwire.protocol.placement import Member

_EVENTS = 200  # recent events kept for status pages


@dataclass
class Lifecycle:
    """A job's state and its moves from one generation to the next."""

    config: RendezvousConfig
    state: JobState = JobState.WAITING
    failure: FailureRecord | None = None
    inquest: Inquest | None = None
    gens: Generations = field(default_factory=Generations)
    _workers: dict[ConnId, Worker] = field(default_factory=dict)
    _joins: JoinIndex = field(default_factory=JoinIndex)  # what _workers' joins claim
    _beats: dict[ConnId, None] = field(default_factory=dict)  # oldest heartbeat first
    _members: list[Member] = field(default_factory=list)  # the formed generation's, by rank
    _by_rank: dict[int, Worker] = field(default_factory=dict)  # its workers, by rank
    # a forming generation's workers that asked for a rank (as an agent's do), by it
    _requested: dict[int, Worker] = field(default_factory=dict)
    _left: int = 0  # its workers that left cleanly
    _old: dict[ConnId, Worker] = field(default_factory=dict)  # an ended generation's
    # joins of survivors re-forming in their processes, taken when the next one forms
    _parked: dict[ConnId, tuple[Join, str]] = field(default_factory=dict)
    _restart: Restart | None = None  # what the agents were told when the last generation ended
    _agents: dict[ConnId, Agent] = field(default_factory=dict)
    _shape: Shape | None = None
    _world: int | None = None  # this generation's world size, once agents are assigned
    _deadline: float | None = None  # for the generation to form, or the restart to end
    _last_call: float | None = None  # when waiting for more nodes ends
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=_EVENTS))
    curves: Curves = field(default_factory=Curves)  # rank 0's loss, held-out loss, pace
    stragglers: Stragglers = field(default_factory=Stragglers)  # the running generation's
    links: LinkTable = field(default_factory=LinkTable)  # its peer links, as ranks report them

    _now: float = 0.0  # the latest time an input carried (events are stamped with it)

    def __post_init__(self) -> None:
        self.gens.max_restarts = self.config.max_restarts or 0

    @property
    def generation(self) -> int:
        """The generation being formed or running."""
        return self.gens.current

    @property
    def shape(self) -> Shape | None:
        """The forming or running generation's shape (None before anyone joined)."""
        return self._generation_shape() if self._shape else None

    def worker_of(self, rank: int) -> Worker | None:
        """The running generation's worker of ``rank``, if there is one."""
        return self._by_rank.get(rank)

    @property
    def workers(self) -> list[Worker]:
        """The forming or running generation's workers."""
        return list(self._workers.values())

    def rows(self, offset: int = 0, limit: int | None = None) -> tuple[list[Worker], int]:
        """Workers ``offset`` onwards (at most ``limit``) by rank, then node id, and how
        many there are; a formed generation's in rank order without sorting them all."""
        total = len(self._workers)
        end = total if limit is None else min(total, offset + limit)
        if self._by_rank and len(self._by_rank) == total:
            return [self._by_rank[r] for r in range(offset, end)], total
        ordered = sorted(self._workers.values(), key=lambda w: (w.rank, w.join.node_id))
        return ordered[offset:end], total

    def _event(self, text: str, now: float | None = None) -> None:
        if now is not None:
            self._now = now
        self.events.append((self._now, text))

    def _may_grow(self) -> bool:
        shape = self._shape
        return bool(shape and shape.min_nodes and len(self._agents) < shape.nnodes)

    def _generation_shape(self) -> Shape:
        assert self._shape is not None
        return self._shape.sized(self._world) if self._world else self._shape

    def _advance(self, now: float) -> list[Action]:
        """Move on when what is awaited has happened: the end of a restart, then the
        node assignment once enough agents are in."""
        parked: list[Action] = []
        if self.state is JobState.RESTARTING:
            if self._old or not all(a.ready for a in self._agents.values()):
                return []
            self._reopen(now)
            parked = self._unpark(now)
        return parked + self._form(now)

    def _unpark(self, now: float) -> list[Action]:
        """The joins that came while the ended generation's processes were going (from
        survivors re-forming in their processes), taken now that the next one forms."""
        return []

    def _form(self, now: float) -> list[Action]:
        if self.state is not JobState.WAITING or self._world is not None or not self._agents:
            return []
        assert self._shape is not None
        shape = self._shape
        low = shape.min_nodes or shape.nnodes
        count = len(self._agents)
        if count < low:
            self._last_call = None  # a node left before the last call ended
        elif self._last_call is None and count < shape.nnodes:
            self._last_call = now + self.config.last_call
            self._event(
                f"{count} of {low}..{shape.nnodes} nodes in; more may join for "
                f"{self.config.last_call:g} s",
                now,
            )
        over = self._last_call is not None and now >= self._last_call
        if count < shape.nnodes and not (count >= low and over):
            return []
        return self._assign(now)

    def _assign(self, now: float) -> list[Action]:
        assert self._shape is not None
        self._world, actions = assignments(
            self._agents.values(), self._shape, self.gens, now, grace=self.config.grace
        )
        self._deadline = now + self.config.join_timeout
        return actions + self._complete(now)

    def _complete(self, now: float) -> list[Action]:
        """Start the generation just assigned if its every worker has joined already:
        survivors re-forming in their processes join before the nodes are assigned, and
        after a node's loss they may be all of a smaller generation."""
        return []

    def _reopen(self, now: float) -> None:
        """Generation g's processes are gone: generation g+1 starts forming (the ended
        generation's workers, world size and node ranks were let go when it ended)."""
        self.state = JobState.WAITING
        self._last_call = None
        self._deadline = now + self.config.join_timeout
        self._event(f"generation {self.generation} forming", now)

    def _agent_lost(self, agent: Agent) -> list[Action]:
        node = agent.join.node_id
        self._event(f"node {node!r} left (its agent's connection closed)")
        if agent.node_rank is None:
            return self._advance(self._now)
        if self.state is JobState.WAITING:
            # its processes will never join the forming generation: form it again
            return self._end_generation(-1, f"node {node!r} left", failure=False)
        if self.state is JobState.RUNNING and self.gens.restarts_left:
            lws = self._generation_shape().local_world_size
            return self._end_generation(
                agent.node_rank * lws, f"node {node!r} lost (its agent is gone)", failure=True
            )
        return []

    def _abort(
        self, rank: int, reason: str, traceback: str = "", *, stacks: str = ""
    ) -> list[Action]:
        """A rank failed: restart while the budget lasts, else end the job."""
        if self.gens.restarts_left:
            return self._end_generation(rank, reason, traceback, stacks=stacks, failure=True)
        self.state = JobState.FAILED
        self.failure = FailureRecord(rank, reason, traceback, stacks)
        self.gens.end(f"rank {rank} failed: {reason}", self._now)
        self._event(f"rank {rank} failed: {reason}")
        abort = Abort(rank=rank, reason=reason, traceback=traceback, stacks=stacks)
        return [Send(conn, abort) for conn in self._listeners()]

    def _live_workers(self) -> list[ConnId]:
        """Every connected worker of this generation that has not finished."""
        return [
            w.conn for w in self._workers.values() if w.connected and w.state is not RankState.LEFT
        ]

    def _listeners(self) -> list[ConnId]:
        """Every live worker and every agent."""
        return self._live_workers() + list(self._agents)

    def _end_generation(
        self, rank: int, reason: str, traceback: str = "", *, stacks: str = "", failure: bool
    ) -> list[Action]:
        """End this generation and open the next once its processes are gone."""
        forming = self.state is JobState.WAITING
        cause = f"rank {rank} failed: {reason}" if failure else f"membership change: {reason}"
        self.gens.end(cause, self._now)
        ended = self.generation
        self.gens.advance(failure=failure)
        self.failure = FailureRecord(rank, reason, traceback, stacks) if failure else None
        self.inquest = None
        self.state = JobState.RESTARTING
        self._deadline = self._now + self.config.join_timeout
        used = f" (restart {self.gens.restarts} of {self.gens.max_restarts})" if failure else ""
        self._event(f"generation {ended} ended: {cause}; restarting{used}")
        abort = Abort(rank=rank, reason=reason, traceback=traceback, stacks=stacks, restarting=True)
        if forming:  # ended before it formed: the survivors that joined it, re-forming
            # in their processes, join the next one instead (they were told nothing)
            for conn, w in list(self._workers.items()):
                if w.join.reforming and w.connected:
                    self._parked[conn] = (w.join, w.host)
                    del self._workers[conn]
        restart = Restart(
            generation=self.generation,
            rank=rank,
            reason=cause,
            restarts=self.gens.restarts,
            max_restarts=self.gens.max_restarts,
        )
        self._restart = restart
        actions: list[Action] = [Send(c, abort) for c in self._live_workers()]
        for a in self._agents.values():
            if a.node_rank is not None:  # it started processes for the ended generation
                actions.append(Send(a.conn, restart))
                a.ready = False
                a.node_rank = None
        self._old = {c: w for c, w in self._workers.items() if w.connected}
        self._workers = {}
        self._joins = JoinIndex()
        self._members = []
        self._by_rank = {}
        self._requested = {}
        self._world = None
        return actions + self._advance(self._now)

    def _give_up(self, why: str) -> list[Action]:
        """A restart could not complete: the job fails with the cause that started it."""
        last = self.failure or FailureRecord(-1, "membership change")
        reason = f"{last.reason}; restart failed: {why}"
        self.gens.max_restarts = self.gens.restarts  # no further restart
        self.state = JobState.FAILED
        self.failure = FailureRecord(last.rank, reason, last.traceback, last.stacks)
        self._event(f"job failed: {reason}")
        abort = Abort(rank=last.rank, reason=reason, traceback=last.traceback, stacks=last.stacks)
        conns = list(self._old) + list(self._parked) + self._listeners()
        self._parked = {}
        return [Send(c, abort) for c in conns]
