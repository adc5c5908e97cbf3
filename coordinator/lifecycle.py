"""The job across generations (pure): forming one from its nodes' and workers' joins,
starting it, ending it (a failure, a membership change, or every rank finished), and
restarting.

:class:`Lifecycle` holds the job's state and makes every transition between generations; the
rendezvous (``coordinator.rendezvous``) has a job, its liveness (``liveness``) and its
recovery from a journal (``recovery``), and hands each input to the part it concerns.
Ending a generation (a failure with restarts left, or a membership change) aborts its
workers, tells the agents to ``Restart``, and waits until every agent has rejoined and
every old worker connection has closed before the next generation forms: no rank of g+1
starts while a process of g is alive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardwire.coordinator.diagnosis import Inquest
from shardwire.coordinator.forming import agreement_problem, assignments, placements
from shardwire.coordinator.generations import Generations
from shardwire.coordinator.linktable import LinkTable
from shardwire.coordinator.membership import (
    JoinIndex,
    Shape,
    assign_node_ranks,
    describe_missing,
    shape_problem,
)
from shardwire.coordinator.progress import Curves
from shardwire.coordinator.state import (
    Action,
    Agent,
    Close,
    ConnId,
    FailureRecord,
    JobState,
    RankState,
    RendezvousConfig,
    Send,
    Worker,
    refuse,
)
from shardwire.coordinator.stragglers import Stragglers
from shardwire.protocol.messages import Abort, Finished, Join, Leave, NodeJoin, Restart
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
    joined: dict[ConnId, Worker] = field(default_factory=dict)
    join_index: JoinIndex = field(default_factory=JoinIndex)  # what the joined workers' joins claim
    beat_order: dict[ConnId, None] = field(default_factory=dict)  # oldest heartbeat first
    members: list[Member] = field(default_factory=list)  # the formed generation's, by rank
    by_rank: dict[int, Worker] = field(default_factory=dict)  # its workers, by rank
    # a forming generation's workers that asked for a rank (as an agent's do), by it
    requested: dict[int, Worker] = field(default_factory=dict)
    left_count: int = 0  # its workers that left cleanly
    old: dict[ConnId, Worker] = field(default_factory=dict)  # an ended generation's
    # joins of survivors re-forming in their processes, taken when the next one forms
    parked: dict[ConnId, tuple[Join, str]] = field(default_factory=dict)
    last_restart: Restart | None = None  # what the agents were told when the last generation ended
    agents: dict[ConnId, Agent] = field(default_factory=dict)
    job_shape: Shape | None = None
    world: int | None = None  # this generation's world size, once agents are assigned
    deadline: float | None = None  # for the generation to form, or the restart to end
    last_call_at: float | None = None  # when waiting for more nodes ends
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=_EVENTS))
    curves: Curves = field(default_factory=Curves)  # rank 0's loss, held-out loss, pace
    stragglers: Stragglers = field(default_factory=Stragglers)  # the running generation's
    links: LinkTable = field(default_factory=LinkTable)  # its peer links, as ranks report them

    now: float = 0.0  # the latest time an input carried (events are stamped with it)

    def __post_init__(self) -> None:
        self.gens.max_restarts = self.config.max_restarts or 0

    @property
    def generation(self) -> int:
        """The generation being formed or running."""
        return self.gens.current

    @property
    def shape(self) -> Shape | None:
        """The forming or running generation's shape (None before anyone joined)."""
        return self.generation_shape() if self.job_shape else None

    def worker_of(self, rank: int) -> Worker | None:
        """The running generation's worker of ``rank``, if there is one."""
        return self.by_rank.get(rank)

    @property
    def workers(self) -> list[Worker]:
        """The forming or running generation's workers."""
        return list(self.joined.values())

    def rows(self, offset: int = 0, limit: int | None = None) -> tuple[list[Worker], int]:
        """Workers ``offset`` onwards (at most ``limit``) by rank, then node id, and how
        many there are; a formed generation's in rank order without sorting them all."""
        total = len(self.joined)
        end = total if limit is None else min(total, offset + limit)
        if self.by_rank and len(self.by_rank) == total:
            return [self.by_rank[r] for r in range(offset, end)], total
        ordered = sorted(self.joined.values(), key=lambda w: (w.rank, w.join.node_id))
        return ordered[offset:end], total

    def event(self, text: str, now: float | None = None) -> None:
        if now is not None:
            self.now = now
        self.events.append((self.now, text))

    def may_grow(self) -> bool:
        shape = self.job_shape
        return bool(shape and shape.min_nodes and len(self.agents) < shape.nnodes)

    def generation_shape(self) -> Shape:
        assert self.job_shape is not None
        return self.job_shape.sized(self.world) if self.world else self.job_shape

    def _admit(
        self, conn: ConnId, world_size: int, lws: int, now: float, *, agent: bool
    ) -> list[Action] | None:
        """Check a joiner's sizes against the job's: an agent's against the largest job,
        a worker's against its generation."""
        expected = self.config.world_size if agent else self.world or self.config.world_size
        problem = shape_problem(expected, self.job_shape, world_size, lws)
        if problem:
            return refuse(conn, "world_size", problem)
        self.job_shape = self.job_shape or Shape(world_size, lws)
        if self.deadline is None and self.state is JobState.WAITING:
            self.deadline = now + self.config.join_timeout
        return None

    def _started(self, conn: ConnId) -> list[Action]:
        return refuse(conn, "already_started", f"job {self.config.run_id!r} is {self.state.value}")

    def node_join(self, conn: ConnId, msg: NodeJoin, now: float) -> list[Action]:
        self.now = now
        agent = self.agents.get(conn)
        if agent is not None:  # again: its processes of the ended generation are gone
            agent.ready = True
            return self.advance(now)
        growing = self.state is JobState.RUNNING and self.may_grow()
        if self.state not in (JobState.WAITING, JobState.RESTARTING) and not growing:
            return self._started(conn)
        refusal = self._admit(conn, msg.world_size, msg.local_world_size, now, agent=True)
        refusal = refusal or self._agree(conn, msg)
        if refusal:
            return refusal
        if any(a.join.node_id == msg.node_id for a in self.agents.values()):
            return refuse(conn, "duplicate_rank", f"node {msg.node_id!r} already has an agent")
        if msg.node_index is not None and (
            twin := next(
                (a for a in self.agents.values() if a.join.node_index == msg.node_index), None
            )
        ):
            return refuse(
                conn,
                "duplicate_rank",
                f"node index {msg.node_index} is already node {twin.join.node_id!r}'s "
                f"(this is node {msg.node_id!r})",
            )
        assert self.job_shape is not None
        if len(self.agents) >= self.job_shape.nnodes:
            return refuse(conn, "world_size", f"all {self.job_shape.nnodes} nodes already joined")
        self.agents[conn] = Agent(conn, msg)
        self.event(f"node {msg.node_id!r} joined", now)
        if growing:
            return self.end_generation(-1, f"node {msg.node_id!r} joined", failure=False)
        return self.advance(now)

    def _agree(self, conn: ConnId, msg: NodeJoin) -> list[Action] | None:
        assert self.job_shape is not None
        first = not self.agents and self.generation == 1 and not self.joined
        problem = agreement_problem(self.config, self.job_shape, self.gens, msg, first=first)
        return refuse(conn, *problem) if problem else None

    def join(self, conn: ConnId, msg: Join, *, peer_host: str, now: float) -> list[Action]:
        if self.state is JobState.RESTARTING and msg.requested_rank is not None:
            # a survivor re-forming in its process: it joins the next generation once the
            # ended one's processes are gone (bounded by the restart's own deadline)
            self.parked[conn] = (msg, peer_host)
            return []
        if self.state is not JobState.WAITING:
            return self._started(conn)
        world = msg.world_size
        if msg.reforming:  # it cannot know the next generation's size (after a grow, say)
            shaped = self.job_shape.world_size if self.job_shape else None
            world = self.world or self.config.world_size or shaped or world
        refusal = self._admit(conn, world, msg.local_world_size, now, agent=False)
        if refusal:
            return refusal
        shape = self.generation_shape()
        problem = self.join_index.problem(shape, msg)
        if problem:
            code, text = problem
            return refuse(conn, code, text)
        host = msg.listen_host or peer_host
        worker = self.joined[conn] = Worker(conn, msg, host, now)
        self.join_index.add(msg, shape.local_world_size)
        if msg.requested_rank is not None:  # its agent may beat for it before it forms
            self.requested[msg.requested_rank] = worker
        self.event(
            f"worker joined from {host} (node {msg.node_id!r}, local rank {msg.local_rank})", now
        )
        if len(self.joined) < shape.world_size:
            return []
        return self._start(now)

    def advance(self, now: float) -> list[Action]:
        """Move on when what is awaited has happened: the end of a restart, then the
        node assignment once enough agents are in."""
        parked: list[Action] = []
        if self.state is JobState.RESTARTING:
            if self.old or not all(a.ready for a in self.agents.values()):
                return []
            self._reopen(now)
            parked = self._unpark(now)
        return parked + self._form(now)

    def _unpark(self, now: float) -> list[Action]:
        parked, self.parked = self.parked, {}
        actions: list[Action] = []
        for conn, (msg, host) in parked.items():
            actions += self.join(conn, msg, peer_host=host, now=now)
        return actions

    def _form(self, now: float) -> list[Action]:
        if self.state is not JobState.WAITING or self.world is not None or not self.agents:
            return []
        assert self.job_shape is not None
        shape = self.job_shape
        low = shape.min_nodes or shape.nnodes
        count = len(self.agents)
        if count < low:
            self.last_call_at = None  # a node left before the last call ended
        elif self.last_call_at is None and count < shape.nnodes:
            self.last_call_at = now + self.config.last_call
            self.event(
                f"{count} of {low}..{shape.nnodes} nodes in; more may join for "
                f"{self.config.last_call:g} s",
                now,
            )
        over = self.last_call_at is not None and now >= self.last_call_at
        if count < shape.nnodes and not (count >= low and over):
            return []
        return self._assign(now)

    def _assign(self, now: float) -> list[Action]:
        assert self.job_shape is not None
        self.world, actions = assignments(
            self.agents.values(), self.job_shape, self.gens, now, grace=self.config.grace
        )
        self.deadline = now + self.config.join_timeout
        return actions + self._complete(now)

    def _complete(self, now: float) -> list[Action]:
        if self.joined and len(self.joined) >= self.generation_shape().world_size:
            return self._start(now)
        return []

    def _start(self, now: float) -> list[Action]:
        shape = self.generation_shape()
        lws = shape.local_world_size
        node_ranks = assign_node_ranks(shape, [w.join for w in self.joined.values()])
        self.left_count = 0
        for w in self.joined.values():
            w.rank = node_ranks[w.join.node_id] * lws + w.join.local_rank
            w.state = RankState.RUNNING
            w.last_seen = now  # building the peer mesh comes next; the clock starts here
        # by rank: of workers silent equally long, the lowest rank is named
        self.beat_order = {w.conn: None for w in sorted(self.joined.values(), key=lambda w: w.rank)}
        self.state = JobState.RUNNING
        self.deadline = None
        nodes = sum(1 for a in self.agents.values() if a.node_rank is not None)
        self.gens.begin(shape.world_size, nodes, now)
        self.stragglers = Stragglers()  # sequences start again with the generation
        self.links = LinkTable()  # so do connections and their totals
        self.event(
            f"all {shape.world_size} workers joined; job running (generation {self.generation})",
            now,
        )
        self.members, actions = placements(
            self.joined.values(), shape, self.generation, grace=self.config.grace
        )
        self.by_rank = {w.rank: w for w in self.joined.values()}
        self.requested = {}
        if self.may_grow() and any(a.node_rank is None for a in self.agents.values()):
            # a node arrived while this generation formed: take it in with the next one
            late = next(a for a in self.agents.values() if a.node_rank is None)
            actions += self.end_generation(-1, f"node {late.join.node_id!r} joined", failure=False)
        return actions

    def _reopen(self, now: float) -> None:
        """Generation g's processes are gone: generation g+1 starts forming (the ended
        generation's workers, world size and node ranks were let go when it ended)."""
        self.state = JobState.WAITING
        self.last_call_at = None
        self.deadline = now + self.config.join_timeout
        self.event(f"generation {self.generation} forming", now)

    def agent_lost(self, agent: Agent) -> list[Action]:
        node = agent.join.node_id
        self.event(f"node {node!r} left (its agent's connection closed)")
        if agent.node_rank is None:
            return self.advance(self.now)
        if self.state is JobState.WAITING:
            # its processes will never join the forming generation: form it again
            return self.end_generation(-1, f"node {node!r} left", failure=False)
        if self.state is JobState.RUNNING and self.gens.restarts_left:
            lws = self.generation_shape().local_world_size
            return self.end_generation(
                agent.node_rank * lws, f"node {node!r} lost (its agent is gone)", failure=True
            )
        return []

    def fail(self, worker: Worker, reason: str, traceback: str = "") -> list[Action]:
        worker.state = RankState.FAILED
        if self.state is not JobState.RUNNING:
            return []
        return self.abort(worker.rank, reason, traceback)

    def abort(
        self, rank: int, reason: str, traceback: str = "", *, stacks: str = ""
    ) -> list[Action]:
        """A rank failed: restart while the budget lasts, else end the job."""
        if self.gens.restarts_left:
            return self.end_generation(rank, reason, traceback, stacks=stacks, failure=True)
        self.state = JobState.FAILED
        self.failure = FailureRecord(rank, reason, traceback, stacks)
        self.gens.end(f"rank {rank} failed: {reason}", self.now)
        self.event(f"rank {rank} failed: {reason}")
        abort = Abort(rank=rank, reason=reason, traceback=traceback, stacks=stacks)
        return [Send(conn, abort) for conn in self.listeners()]

    def live_workers(self) -> list[ConnId]:
        """Every connected worker of this generation that has not finished."""
        return [
            w.conn for w in self.joined.values() if w.connected and w.state is not RankState.LEFT
        ]

    def listeners(self) -> list[ConnId]:
        """Every live worker and every agent."""
        return self.live_workers() + list(self.agents)

    def end_generation(
        self, rank: int, reason: str, traceback: str = "", *, stacks: str = "", failure: bool
    ) -> list[Action]:
        """End this generation and open the next once its processes are gone."""
        forming = self.state is JobState.WAITING
        cause = f"rank {rank} failed: {reason}" if failure else f"membership change: {reason}"
        self.gens.end(cause, self.now)
        ended = self.generation
        self.gens.advance(failure=failure)
        self.failure = FailureRecord(rank, reason, traceback, stacks) if failure else None
        self.inquest = None
        self.state = JobState.RESTARTING
        self.deadline = self.now + self.config.join_timeout
        used = f" (restart {self.gens.restarts} of {self.gens.max_restarts})" if failure else ""
        self.event(f"generation {ended} ended: {cause}; restarting{used}")
        abort = Abort(rank=rank, reason=reason, traceback=traceback, stacks=stacks, restarting=True)
        if forming:  # ended before it formed: the survivors that joined it, re-forming
            # in their processes, join the next one instead (they were told nothing)
            for conn, w in list(self.joined.items()):
                if w.join.reforming and w.connected:
                    self.parked[conn] = (w.join, w.host)
                    del self.joined[conn]
        restart = Restart(
            generation=self.generation,
            rank=rank,
            reason=cause,
            restarts=self.gens.restarts,
            max_restarts=self.gens.max_restarts,
        )
        self.last_restart = restart
        actions: list[Action] = [Send(c, abort) for c in self.live_workers()]
        for a in self.agents.values():
            if a.node_rank is not None:  # it started processes for the ended generation
                actions.append(Send(a.conn, restart))
                a.ready = False
                a.node_rank = None
        self.old = {c: w for c, w in self.joined.items() if w.connected}
        self.joined = {}
        self.join_index = JoinIndex()
        self.members = []
        self.by_rank = {}
        self.requested = {}
        self.world = None
        return actions + self.advance(self.now)

    def give_up(self, why: str) -> list[Action]:
        """A restart could not complete: the job fails with the cause that started it."""
        last = self.failure or FailureRecord(-1, "membership change")
        reason = f"{last.reason}; restart failed: {why}"
        self.gens.max_restarts = self.gens.restarts  # no further restart
        self.state = JobState.FAILED
        self.failure = FailureRecord(last.rank, reason, last.traceback, last.stacks)
        self.event(f"job failed: {reason}")
        abort = Abort(rank=last.rank, reason=reason, traceback=last.traceback, stacks=last.stacks)
        conns = list(self.old) + list(self.parked) + self.listeners()
        self.parked = {}
        return [Send(c, abort) for c in conns]

    def withdraw(self, worker: Worker) -> None:
        """A worker of the forming generation disconnected: its join no longer counts."""
        del self.joined[worker.conn]
        self.join_index.remove(worker.join, worker.join.local_world_size)
        asked = worker.join.requested_rank
        if asked is not None and self.requested.get(asked) is worker:
            del self.requested[asked]

    def leave(self, conn: ConnId, msg: Leave) -> list[Action]:
        worker = self.joined.get(conn)
        if worker is None or worker.state is not RankState.RUNNING:
            return []
        worker.state = RankState.LEFT
        self.left_count += 1  # counted, not scanned: a thousand leaves stay linear
        self.event(f"rank {worker.rank} finished")
        if self.state is JobState.RUNNING and self.left_count == len(self.joined):
            self.state = JobState.FINISHED
            self.gens.end("finished", self.now)
            self.event("job finished")
            return [Send(a, Finished(generation=self.generation)) for a in self.agents]
        return []

    def join_timeout(self) -> list[Action]:
        message = f"join timeout after {self.config.join_timeout:g} s: {self.missing()}"
        self.event(message)
        if self.generation > 1:  # a restart that never formed: the job is over
            return self.give_up(message) + [Close(c) for c in self.joined]
        conns = list(self.joined) + list(self.agents)
        self.joined.clear()
        self.join_index = JoinIndex()
        self.members = []
        self.by_rank = {}
        self.requested = {}
        self.agents.clear()
        self.deadline = None
        self.last_call_at = None
        self.world = None
        self.job_shape = None
        actions: list[Action] = []
        for conn in conns:
            actions += refuse(conn, "join_timeout", message)
        return actions

    def missing(self) -> str:
        """Describe who has not joined yet (used in timeout errors and status)."""
        joins = [w.join for w in self.joined.values()]
        return describe_missing(self.shape, joins, agents=len(self.agents))

    @property
    def assigned(self) -> bool:
        """Whether a generation's nodes are assigned (it forms, or runs)."""
        return self.world is not None

    @property
    def between(self) -> bool:
        """Whether the job is between generations: one ended, the next not assigned."""
        waiting = self.state in (JobState.RESTARTING, JobState.WAITING) and not self.assigned
        return waiting and bool(self.gens.eras)
