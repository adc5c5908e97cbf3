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
  Heartbeats also say when a worker's event loop is busy; that is logged, never failed.
* FAILING: a worker gave up on a collective (timeout). Every live worker is asked for
  its flight recorder and stack; once all answered or ``diagnose_timeout`` passed, the
  verdict (who never entered the call, and where it is) goes out as the ``Abort``.
* FINISHED: every worker sent ``Leave``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardwire.coordinator.diagnosis import Inquest
from shardwire.coordinator.membership import (
    Shape,
    assign_node_ranks,
    describe_missing,
    membership_problem,
    shape_problem,
)
from shardwire.coordinator.state import (
    Action,
    Agent,
    ConnId,
    FailureRecord,
    JobState,
    Notice,
    RankState,
    RendezvousConfig,
    Send,
    Worker,
    refuse,
)
from shardwire.protocol.messages import (
    Abort,
    DiagnoseReply,
    DiagnoseRequest,
    Diagnosis,
    Failure,
    Heartbeat,
    Join,
    Leave,
    Member,
    NodeAssignment,
    NodeJoin,
    RankStatus,
    Roster,
    StatusReply,
)

_EVENTS = 200  # recent events kept for status pages
_LOSSES = 2000  # rank 0's reported losses kept for the loss curve


@dataclass
class Rendezvous:
    """One job's membership, rank assignment and liveness."""

    config: RendezvousConfig
    state: JobState = JobState.WAITING
    generation: int = 0
    failure: FailureRecord | None = None
    inquest: Inquest | None = None
    _workers: dict[ConnId, Worker] = field(default_factory=dict)
    _agents: dict[ConnId, Agent] = field(default_factory=dict)
    _shape: Shape | None = None
    _deadline: float | None = None
    events: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=_EVENTS))
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_LOSSES))

    _now: float = 0.0  # the latest time an input carried (events are stamped with it)

    def _event(self, text: str, now: float | None = None) -> None:
        if now is not None:
            self._now = now
        self.events.append((self._now, text))

    # ---- joins -------------------------------------------------------------------

    def _admit(self, conn: ConnId, world_size: int, lws: int, now: float) -> list[Action] | None:
        if self.state is not JobState.WAITING:
            return refuse(
                conn, "already_started", f"job {self.config.run_id!r} is {self.state.value}"
            )
        problem = shape_problem(self.config.world_size, self._shape, world_size, lws)
        if problem:
            return refuse(conn, "world_size", problem)
        self._shape = self._shape or Shape(world_size, lws)
        if self._deadline is None:
            self._deadline = now + self.config.join_timeout
        return None

    def node_join(self, conn: ConnId, msg: NodeJoin, now: float) -> list[Action]:
        refusal = self._admit(conn, msg.world_size, msg.local_world_size, now)
        if refusal:
            return refusal
        if any(a.join.node_id == msg.node_id for a in self._agents.values()):
            return refuse(conn, "duplicate_rank", f"node {msg.node_id!r} already has an agent")
        assert self._shape is not None
        if len(self._agents) >= self._shape.nnodes:
            return refuse(conn, "world_size", f"all {self._shape.nnodes} nodes already joined")
        self._agents[conn] = Agent(conn, msg)
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
        assert self._shape is not None
        problem = membership_problem(self._shape, [w.join for w in self._workers.values()], msg)
        if problem:
            code, text = problem
            return refuse(conn, code, text)
        host = msg.listen_host or peer_host
        self._workers[conn] = Worker(conn, msg, host, now)
        self._event(
            f"worker joined from {host} (node {msg.node_id!r}, local rank {msg.local_rank})", now
        )
        assert self._shape is not None
        if len(self._workers) < self._shape.world_size:
            return []
        return self._start(now)

    # ---- start -------------------------------------------------------------------

    def _start(self, now: float) -> list[Action]:
        assert self._shape is not None
        lws = self._shape.local_world_size
        node_ranks = assign_node_ranks(self._shape, [w.join for w in self._workers.values()])
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
        if worker is None:
            return []
        worker.last_seen = now
        if msg.loss is not None and msg.loss != worker.progress.loss and worker.rank == 0:
            self.losses.append((msg.step, msg.loss))
        before, worker.progress = worker.progress, msg
        return self._stall_notice(worker, before)

    def _stall_notice(self, worker: Worker, before: Heartbeat) -> list[Action]:
        """Log a busy event loop when it starts and when it ends (never a failure)."""
        who = f"rank {worker.rank}" if worker.rank >= 0 else f"worker on {worker.join.node_id}"
        now = worker.progress
        if now.busy_s and not before.busy_s:
            text = (
                f"{who} busy for {now.busy_s:.0f} s at {now.busy_at or 'an unknown place'} "
                "(its event loop is not running; heartbeats continue, the job goes on)"
            )
        elif before.busy_s and not now.busy_s:
            busy = f"{before.busy_s:.0f} s or more"
            text = f"{who} responsive again (its event loop was busy for {busy})"
        else:
            return []
        self._event(text)
        return [Notice(text)]

    def report_failure(self, conn: ConnId, msg: Failure, now: float) -> list[Action]:
        worker = self._workers.get(conn)
        self._now = now
        if worker is None or worker.rank < 0:
            return []
        if self.state is JobState.FAILING:
            return self._testify(worker, msg.diagnosis, now)
        if msg.rank >= 0 and msg.rank != worker.rank:
            blamed = [w for w in self._workers.values() if w.rank == msg.rank]
            if not blamed:
                return []
            reason = f"{msg.reason} (reported by rank {worker.rank})"
            return self._fail(blamed[0], reason)
        if msg.code == "collective_timeout" and self.state is JobState.RUNNING:
            return self._open_inquest(worker, msg, now)
        return self._fail(worker, msg.reason, msg.traceback)

    def _open_inquest(self, worker: Worker, msg: Failure, now: float) -> list[Action]:
        worker.state = RankState.FAILED
        self.state = JobState.FAILING
        self._event(f"rank {worker.rank}: {msg.reason}; asking every rank what it is doing")
        live = [w for w in self._workers.values() if w.state is RankState.RUNNING]
        self.inquest = Inquest(
            reporter=worker.rank,
            reason=msg.reason,
            deadline=now + self.config.diagnose_timeout,
            asked={w.rank for w in live},
        )
        self.inquest.add(worker.rank, msg.diagnosis)
        return [Send(w.conn, DiagnoseRequest()) for w in live] + self._conclude(now)

    def diagnosis(self, conn: ConnId, msg: DiagnoseReply, now: float) -> list[Action]:
        worker = self._workers.get(conn)
        self._now = now
        if worker is None or self.state is not JobState.FAILING:
            return []
        return self._testify(worker, msg.diagnosis, now)

    def _testify(self, worker: Worker, diagnosis: Diagnosis | None, now: float) -> list[Action]:
        assert self.inquest is not None
        if worker.state is RankState.RUNNING and diagnosis is None:
            worker.state = RankState.FAILED  # it failed too, without saying more
        self.inquest.add(worker.rank, diagnosis)
        return self._conclude(now)

    def _conclude(self, now: float) -> list[Action]:
        inquest = self.inquest
        if inquest is None or not inquest.complete(now):
            return []
        assert self._shape is not None
        verdict = inquest.verdict(self._shape.world_size)
        self.inquest = None
        return self._abort(verdict.rank, verdict.reason, stacks=verdict.stacks)

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
        worker.connected = False
        if self.inquest is not None:
            worker.state = RankState.FAILED
            self.inquest.add(worker.rank, None)
            return self._conclude(self._now)
        if worker.state is RankState.RUNNING:
            return self._fail(worker, "connection to the coordinator closed (process died?)")
        return []

    def tick(self, now: float) -> list[Action]:
        self._now = now
        if self.state is JobState.WAITING and self._deadline is not None and now > self._deadline:
            return self._join_timeout()
        if self.state is JobState.FAILING:
            return self._conclude(now)
        if self.state is not JobState.RUNNING:
            return []
        limit = self.config.heartbeat_timeout
        for w in sorted(self._workers.values(), key=lambda w: w.rank):
            if w.state is RankState.RUNNING and now - w.last_seen > limit:
                silent = now - w.last_seen
                return self._fail(w, f"no heartbeat for {silent:.1f} s (hung or partitioned)")
        return []

    def _fail(self, worker: Worker, reason: str, traceback: str = "") -> list[Action]:
        worker.state = RankState.FAILED
        if self.state is not JobState.RUNNING:
            return []
        return self._abort(worker.rank, reason, traceback)

    def _abort(
        self, rank: int, reason: str, traceback: str = "", *, stacks: str = ""
    ) -> list[Action]:
        """End the job: record the root cause and tell every worker and agent still here."""
        self.state = JobState.FAILED
        self.failure = FailureRecord(rank, reason, traceback, stacks)
        self._event(f"rank {rank} failed: {reason}")
        abort = Abort(rank=rank, reason=reason, traceback=traceback, stacks=stacks)
        targets = [
            w.conn for w in self._workers.values() if w.connected and w.state is not RankState.LEFT
        ]
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
            actions += refuse(conn, "join_timeout", message)
        return actions

    def missing(self) -> str:
        """Describe who has not joined yet (used in timeout errors and status)."""
        joins = [w.join for w in self._workers.values()]
        return describe_missing(self._shape, joins, agents=len(self._agents))

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
