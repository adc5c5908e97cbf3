"""The rendezvous and liveness state machine (pure: no sockets, no clock).

Theory of operation
-------------------
Inputs are (connection id, message) pairs plus ``tick(now)``; outputs are
:class:`Send` and :class:`Close` actions that the asyncio server carries out.

* WAITING: node agents (``NodeJoin``) and worker processes (``Join``) arrive. Every join
  is checked at once (run id is checked at the handshake), so a bad joiner hears why
  within one round trip. Agents are answered with their node rank once every node has
  an agent; workers get the roster once ``world_size`` of them have joined.
* Ranks are contiguous per node: node k owns ranks k*L ... k*L+L-1 (L = processes per
  node), so node-local groups exist for hybrid sharding. Requested ranks fix their node's
  rank; the remaining nodes take the remaining node ranks in ``node_id`` order.
* RUNNING: heartbeats are tracked; a closed connection, missed heartbeats or a reported
  failure moves the job to FAILED and broadcasts one ``Abort`` naming the first failure.
* FINISHED: every worker sent ``Leave``.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from shardwire.protocol.messages import (
    Abort,
    Error,
    Failure,
    Heartbeat,
    Join,
    Leave,
    Member,
    Message,
    NodeAssignment,
    NodeJoin,
    RankStatus,
    Roster,
    StatusReply,
)

ConnId = Hashable


class JobState(enum.Enum):
    """Where the job is."""

    WAITING = "waiting"  # accepting joins
    RUNNING = "running"  # roster sent; watching liveness
    FAILED = "failed"  # a worker failed; abort broadcast
    FINISHED = "finished"  # every worker left cleanly


class RankState(enum.Enum):
    """Where one worker is."""

    JOINED = "joined"  # waiting for the world to complete
    RUNNING = "running"  # has the roster, heartbeating
    LEFT = "left"  # finished cleanly
    FAILED = "failed"  # died, hung or raised


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    msg: Message


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId


Action = Send | Close


@dataclass(slots=True)
class _Worker:
    conn: ConnId
    join: Join
    host: str
    last_seen: float
    rank: int = -1
    state: RankState = RankState.JOINED
    progress: Heartbeat = field(default_factory=Heartbeat)  # the last one received


@dataclass(slots=True)
class _Agent:
    conn: ConnId
    join: NodeJoin


@dataclass(frozen=True, slots=True)
class FailureRecord:
    rank: int
    reason: str
    traceback: str = ""


@dataclass(slots=True)
class _Shape:
    world_size: int
    local_world_size: int

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size


@dataclass(frozen=True, slots=True)
class RendezvousConfig:
    run_id: str
    world_size: int | None = None
    join_timeout: float = 300.0
    heartbeat_timeout: float = 5.0


_EVENTS = 200  # recent events kept for status pages
_LOSSES = 2000  # rank 0's reported losses kept for the loss curve


def _refuse(conn: ConnId, code: str, message: str) -> list[Action]:
    return [Send(conn, Error(code=code, message=message)), Close(conn)]


@dataclass
class Rendezvous:
    """One job's membership, rank assignment and liveness."""

    config: RendezvousConfig
    state: JobState = JobState.WAITING
    generation: int = 0
    failure: FailureRecord | None = None
    _workers: dict[ConnId, _Worker] = field(default_factory=dict)
    _agents: dict[ConnId, _Agent] = field(default_factory=dict)
    _shape: _Shape | None = None
    _deadline: float | None = None
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=_EVENTS))
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_LOSSES))

    _now: float = 0.0  # the latest time an input carried (events are stamped with it)

    def _event(self, text: str, now: float | None = None) -> None:
        if now is not None:
            self._now = now
        self.events.append((self._now, text))

    # ---- joins -------------------------------------------------------------------

    def _check_shape(self, world_size: int, local_world_size: int) -> str | None:
        expected = self.config.world_size or (self._shape and self._shape.world_size)
        if expected and world_size != expected:
            return f"world size disagreement: this joiner says {world_size}, the job has {expected}"
        if world_size % local_world_size:
            return (
                f"world size {world_size} is not a multiple of processes per node "
                f"{local_world_size}"
            )
        if self._shape and local_world_size != self._shape.local_world_size:
            return (
                f"processes-per-node disagreement: this joiner says {local_world_size}, "
                f"the job has {self._shape.local_world_size}"
            )
        return None

    def _admit(self, conn: ConnId, world_size: int, lws: int, now: float) -> list[Action] | None:
        if self.state is not JobState.WAITING:
            return _refuse(
                conn, "already_started", f"job {self.config.run_id!r} is {self.state.value}"
            )
        problem = self._check_shape(world_size, lws)
        if problem:
            return _refuse(conn, "world_size", problem)
        self._shape = self._shape or _Shape(world_size, lws)
        if self._deadline is None:
            self._deadline = now + self.config.join_timeout
        return None

    def node_join(self, conn: ConnId, msg: NodeJoin, now: float) -> list[Action]:
        refusal = self._admit(conn, msg.world_size, msg.local_world_size, now)
        if refusal:
            return refusal
        if any(a.join.node_id == msg.node_id for a in self._agents.values()):
            return _refuse(conn, "duplicate_rank", f"node {msg.node_id!r} already has an agent")
        assert self._shape is not None
        if len(self._agents) >= self._shape.nnodes:
            return _refuse(conn, "world_size", f"all {self._shape.nnodes} nodes already joined")
        self._agents[conn] = _Agent(conn, msg)
        if len(self._agents) < self._shape.nnodes:
            return []
        ordered = sorted(self._agents.values(), key=lambda a: a.join.node_id)
        shape = self._shape
        return [
            Send(
                a.conn,
                NodeAssignment(node_rank=i, nnodes=shape.nnodes, world_size=shape.world_size),
            )
            for i, a in enumerate(ordered)
        ]

    def join(self, conn: ConnId, msg: Join, *, peer_host: str, now: float) -> list[Action]:
        refusal = self._admit(conn, msg.world_size, msg.local_world_size, now)
        if refusal:
            return refusal
        problem = self._membership_problem(msg)
        if problem:
            code, text = problem
            return _refuse(conn, code, text)
        host = msg.listen_host or peer_host
        self._workers[conn] = _Worker(conn, msg, host, now)
        self._event(
            f"worker joined from {host} (node {msg.node_id!r}, local rank {msg.local_rank})", now
        )
        assert self._shape is not None
        if len(self._workers) < self._shape.world_size:
            return []
        return self._start(now)

    def _membership_problem(self, msg: Join) -> tuple[str, str] | None:
        assert self._shape is not None
        lws = self._shape.local_world_size
        if msg.local_rank >= lws:
            return "bad_request", f"local rank {msg.local_rank} >= processes per node {lws}"
        same_node = [w.join for w in self._workers.values() if w.join.node_id == msg.node_id]
        if any(j.local_rank == msg.local_rank for j in same_node):
            return (
                "duplicate_rank",
                f"node {msg.node_id!r} already has local rank {msg.local_rank}",
            )
        nodes = {w.join.node_id for w in self._workers.values()}
        if msg.node_id not in nodes and len(nodes) >= self._shape.nnodes:
            return "world_size", f"already {len(nodes)} nodes, the job has {self._shape.nnodes}"
        if msg.requested_rank is None:
            return None
        r = msg.requested_rank
        if r >= self._shape.world_size or r % lws != msg.local_rank:
            return "bad_request", (
                f"requested rank {r} does not fit world size {self._shape.world_size} "
                f"with local rank {msg.local_rank} of {lws}"
            )
        for w in self._workers.values():
            if w.join.requested_rank == r:
                return (
                    "duplicate_rank",
                    f"rank {r} was already requested by node {w.join.node_id!r}",
                )
            other = w.join.requested_rank
            if other is not None and w.join.node_id == msg.node_id and other // lws != r // lws:
                return "bad_request", f"node {msg.node_id!r} requested ranks on two nodes"
            if other is not None and w.join.node_id != msg.node_id and other // lws == r // lws:
                return "duplicate_rank", f"node rank {r // lws} is taken by {w.join.node_id!r}"
        return None

    # ---- start -------------------------------------------------------------------

    def _node_ranks(self) -> dict[str, int]:
        assert self._shape is not None
        lws = self._shape.local_world_size
        fixed: dict[str, int] = {}
        for w in self._workers.values():
            if w.join.requested_rank is not None:
                fixed[w.join.node_id] = w.join.requested_rank // lws
        free = iter(sorted(set(range(self._shape.nnodes)) - set(fixed.values())))
        nodes = sorted({w.join.node_id for w in self._workers.values()} - set(fixed))
        return fixed | {node: next(free) for node in nodes}

    def _start(self, now: float) -> list[Action]:
        assert self._shape is not None
        lws = self._shape.local_world_size
        node_ranks = self._node_ranks()
        for w in self._workers.values():
            w.rank = node_ranks[w.join.node_id] * lws + w.join.local_rank
            w.state = RankState.RUNNING
            w.last_seen = now  # building the peer mesh comes next; the clock starts here
        self.generation += 1
        self.state = JobState.RUNNING
        self._event(
            f"all {self._shape.world_size} workers joined; job running "
            f"(generation {self.generation})",
            now,
        )
        members = sorted(
            (
                Member(
                    rank=w.rank,
                    node_id=w.join.node_id,
                    node_rank=w.rank // lws,
                    local_rank=w.join.local_rank,
                    host=w.host,
                    port=w.join.listen_port,
                )
                for w in self._workers.values()
            ),
            key=lambda m: m.rank,
        )
        return [
            Send(
                w.conn,
                Roster(
                    rank=w.rank,
                    world_size=self._shape.world_size,
                    generation=self.generation,
                    members=members,
                ),
            )
            for w in self._workers.values()
        ]

    # ---- liveness ----------------------------------------------------------------

    def heartbeat(self, conn: ConnId, msg: Heartbeat, now: float) -> list[Action]:
        worker = self._workers.get(conn)
        self._now = now
        if worker is not None:
            worker.last_seen = now
            if msg.loss is not None and msg.loss != worker.progress.loss and worker.rank == 0:
                self.losses.append((msg.step, msg.loss))
            worker.progress = msg
        return []

    def report_failure(self, conn: ConnId, msg: Failure) -> list[Action]:
        worker = self._workers.get(conn)
        if worker is None or worker.rank < 0:
            return []
        if msg.rank >= 0 and msg.rank != worker.rank:
            blamed = [w for w in self._workers.values() if w.rank == msg.rank]
            if not blamed:
                return []
            reason = f"{msg.reason} (reported by rank {worker.rank})"
            return self._fail(blamed[0], reason)
        return self._fail(worker, msg.reason, msg.traceback)

    def leave(self, conn: ConnId, msg: Leave) -> list[Action]:
        worker = self._workers.get(conn)
        if worker is None or worker.state is not RankState.RUNNING:
            return []
        worker.state = RankState.LEFT
        self._event(f"rank {worker.rank} finished")
        if self.state is JobState.RUNNING and all(
            w.state is RankState.LEFT for w in self._workers.values()
        ):
            self.state = JobState.FINISHED
            self._event("job finished")
        return []

    def disconnected(self, conn: ConnId) -> list[Action]:
        self._agents.pop(conn, None)
        worker = self._workers.get(conn)
        if worker is None:
            return []
        if self.state is JobState.WAITING:
            del self._workers[conn]
            return []
        if worker.state is RankState.RUNNING:
            return self._fail(worker, "connection to the coordinator closed (process died?)")
        return []

    def tick(self, now: float) -> list[Action]:
        self._now = now
        if self.state is JobState.WAITING and self._deadline is not None and now > self._deadline:
            return self._join_timeout()
        if self.state is not JobState.RUNNING:
            return []
        limit = self.config.heartbeat_timeout
        for w in sorted(self._workers.values(), key=lambda w: w.rank):
            if w.state is RankState.RUNNING and now - w.last_seen > limit:
                silent = now - w.last_seen
                return self._fail(w, f"no heartbeat for {silent:.1f} s (hung or partitioned)")
        return []

    def _fail(self, worker: _Worker, reason: str, traceback: str = "") -> list[Action]:
        worker.state = RankState.FAILED
        if self.state is not JobState.RUNNING:
            return []
        self.state = JobState.FAILED
        self.failure = FailureRecord(worker.rank, reason, traceback)
        self._event(f"rank {worker.rank} failed: {reason}")
        abort = Abort(rank=worker.rank, reason=reason, traceback=traceback)
        targets = [w.conn for w in self._workers.values() if w.state is RankState.RUNNING]
        targets += list(self._agents)
        return [Send(conn, abort) for conn in targets]

    def _join_timeout(self) -> list[Action]:
        message = f"join timeout after {self.config.join_timeout:g} s: {self.missing()}"
        self._event(message)
        conns = list(self._workers) + list(self._agents)
        self._workers.clear()
        self._agents.clear()
        self._deadline = None
        self._shape = None
        actions: list[Action] = []
        for conn in conns:
            actions += _refuse(conn, "join_timeout", message)
        return actions

    def missing(self) -> str:
        """Describe who has not joined yet (used in timeout errors and status)."""
        if self._shape is None:
            return "nobody joined"
        lws, nnodes = self._shape.local_world_size, self._shape.nnodes
        joined = len(self._workers) if self._workers or not self._agents else len(self._agents)
        unit = "workers" if self._workers or not self._agents else "node agents"
        total = self._shape.world_size if unit == "workers" else nnodes
        requested = {w.join.requested_rank for w in self._workers.values()}
        if unit == "workers" and None not in requested:
            gone = sorted(set(range(self._shape.world_size)) - requested)
            return f"{joined} of {total} {unit} joined; missing ranks {gone}"
        per_node: dict[str, int] = {}
        for w in self._workers.values():
            per_node[w.join.node_id] = per_node.get(w.join.node_id, 0) + 1
        nodes = ", ".join(f"{n} {c}/{lws}" for n, c in sorted(per_node.items()))
        return f"{joined} of {total} {unit} joined" + (f" (nodes: {nodes})" if nodes else "")

    # ---- views -------------------------------------------------------------------

    def status(self, now: float) -> StatusReply:
        """The job as a monitoring client sees it."""
        failure = self.failure
        return StatusReply(
            run_id=self.config.run_id,
            state=self.state.value,
            world_size=self._shape.world_size if self._shape else (self.config.world_size or 0),
            generation=self.generation,
            failure=f"rank {failure.rank}: {failure.reason}" if failure else "",
            ranks=[
                RankStatus(
                    **w.progress.model_dump(exclude={"kind"}),
                    rank=w.rank,
                    node_id=w.join.node_id,
                    host=w.host,
                    state=w.state.value,
                    heartbeat_age_s=round(max(0.0, now - w.last_seen), 3),
                )
                for w in sorted(self._workers.values(), key=lambda w: (w.rank, w.join.node_id))
            ],
        )
