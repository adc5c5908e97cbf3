"""The rendezvous and liveness state machine (pure: no sockets, no clock).

Theory of operation
-------------------
Inputs are (connection id, message) pairs plus ``tick(now)``; outputs are
:class:`Send` and :class:`Close` actions that the asyncio server carries out.

* WAITING: node agents (``NodeJoin``) and worker processes (``Join``) arrive. Every join
  is checked at once (run id and generation are checked at the handshake), so a bad
  joiner hears why within one round trip. Agents are answered with their node rank once
  the generation's nodes are in: all of them, or for ``--nnodes MIN:MAX`` at least MIN
  and a last-call window later (at once at MAX). Workers get their placement once the
  generation's world has joined.
* Ranks are contiguous per node: node k owns ranks k*L ... k*L+L-1 (L = processes per
  node), so node-local groups exist for hybrid sharding. Requested ranks fix their node's
  rank; the remaining nodes take the remaining node ranks in ``node_id`` order, so an
  unchanged membership keeps its ranks across generations.
* RUNNING: heartbeats are tracked; a closed connection, missed heartbeats, a reported
  failure or a lost node agent ends the generation and names the first failure.
  Heartbeats also say when a worker's event loop is busy; that is logged, never failed.
* FAILING: a worker gave up on a collective (timeout). Every live worker is asked for
  its flight recorder and stack; once all answered or ``diagnose_timeout`` passed, the
  verdict (who never entered the call, and where it is) ends the generation.
* RESTARTING: a failure with restarts left, or a membership change, ended generation g.
  Its workers got an ``Abort``, the agents a ``Restart``; generation g+1 opens (WAITING)
  only once every agent said its processes are gone (``NodeJoin`` again) and every
  worker connection of generation g closed.
* FAILED: a failure with no restart left; one ``Abort`` names the root cause.
* FINISHED: every worker sent ``Leave``; agents hear ``Finished``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwire.coordinator.diagnosis import Inquest
from shardwire.coordinator.forming import agreement_problem, placements
from shardwire.coordinator.linktable import LinkTable
from shardwire.coordinator.membership import (
    JoinIndex,
    Shape,
    assign_node_ranks,
    describe_missing,
    shape_problem,
)
from shardwire.coordinator.recovery import Recovery
from shardwire.coordinator.state import (
    Action,
    Agent,
    Close,
    ConnId,
    JobState,
    RankState,
    Record,
    Send,
    Worker,
    refuse,
)
from shardwire.coordinator.stragglers import Stragglers
from shardwire.coordinator.views import status_reply
from shardwire.protocol.messages import (
    DiagnoseReply,
    DiagnoseRequest,
    Diagnosis,
    Failure,
    Finished,
    Join,
    Leave,
    NodeJoin,
    StatusReply,
)
from shardwire.protocol.placement import PeerPage, PeerQuery


@dataclass
class Rendezvous(Recovery):
    """One job's membership, rank assignment and liveness, generation after generation."""

    def _admit(
        self, conn: ConnId, world_size: int, lws: int, now: float, *, agent: bool
    ) -> list[Action] | None:
        """Check a joiner's sizes against the job's: an agent's against the largest job,
        a worker's against its generation."""
        expected = self.config.world_size if agent else self._world or self.config.world_size
        problem = shape_problem(expected, self._shape, world_size, lws)
        if problem:
            return refuse(conn, "world_size", problem)
        self._shape = self._shape or Shape(world_size, lws)
        if self._deadline is None and self.state is JobState.WAITING:
            self._deadline = now + self.config.join_timeout
        return None

    def _started(self, conn: ConnId) -> list[Action]:
        return refuse(conn, "already_started", f"job {self.config.run_id!r} is {self.state.value}")

    def node_join(self, conn: ConnId, msg: NodeJoin, now: float) -> list[Action]:
        self._now = now
        agent = self._agents.get(conn)
        if agent is not None:  # again: its processes of the ended generation are gone
            agent.ready = True
            return self._advance(now)
        growing = self.state is JobState.RUNNING and self._may_grow()
        if self.state not in (JobState.WAITING, JobState.RESTARTING) and not growing:
            return self._started(conn)
        refusal = self._admit(conn, msg.world_size, msg.local_world_size, now, agent=True)
        refusal = refusal or self._agree(conn, msg)
        if refusal:
            return refusal
        if any(a.join.node_id == msg.node_id for a in self._agents.values()):
            return refuse(conn, "duplicate_rank", f"node {msg.node_id!r} already has an agent")
        if msg.node_index is not None and (
            twin := next(
                (a for a in self._agents.values() if a.join.node_index == msg.node_index), None
            )
        ):
            return refuse(
                conn,
                "duplicate_rank",
                f"node index {msg.node_index} is already node {twin.join.node_id!r}'s "
                f"(this is node {msg.node_id!r})",
            )
        assert self._shape is not None
        if len(self._agents) >= self._shape.nnodes:
            return refuse(conn, "world_size", f"all {self._shape.nnodes} nodes already joined")
        self._agents[conn] = Agent(conn, msg)
        self._event(f"node {msg.node_id!r} joined", now)
        if growing:
            return self._end_generation(-1, f"node {msg.node_id!r} joined", failure=False)
        return self._advance(now)

    def _agree(self, conn: ConnId, msg: NodeJoin) -> list[Action] | None:
        assert self._shape is not None
        first = not self._agents and self.generation == 1 and not self._workers
        problem = agreement_problem(self.config, self._shape, self.gens, msg, first=first)
        return refuse(conn, *problem) if problem else None

    def join(self, conn: ConnId, msg: Join, *, peer_host: str, now: float) -> list[Action]:
        if self.state is JobState.RESTARTING and msg.requested_rank is not None:
            # a survivor re-forming in its process: it joins the next generation once the
            # ended one's processes are gone (bounded by the restart's own deadline)
            self._parked[conn] = (msg, peer_host)
            return []
        if self.state is not JobState.WAITING:
            return self._started(conn)
        world = msg.world_size
        if msg.reforming:  # it cannot know the next generation's size (after a grow, say)
            shaped = self._shape.world_size if self._shape else None
            world = self._world or self.config.world_size or shaped or world
        refusal = self._admit(conn, world, msg.local_world_size, now, agent=False)
        if refusal:
            return refusal
        shape = self._generation_shape()
        problem = self._joins.problem(shape, msg)
        if problem:
            code, text = problem
            return refuse(conn, code, text)
        host = msg.listen_host or peer_host
        worker = self._workers[conn] = Worker(conn, msg, host, now)
        self._joins.add(msg, shape.local_world_size)
        if msg.requested_rank is not None:  # its agent may beat for it before it forms
            self._requested[msg.requested_rank] = worker
        self._event(
            f"worker joined from {host} (node {msg.node_id!r}, local rank {msg.local_rank})", now
        )
        if len(self._workers) < shape.world_size:
            return []
        return self._start(now)

    def _complete(self, now: float) -> list[Action]:
        if self._workers and len(self._workers) >= self._generation_shape().world_size:
            return self._start(now)
        return []

    def _start(self, now: float) -> list[Action]:
        shape = self._generation_shape()
        lws = shape.local_world_size
        node_ranks = assign_node_ranks(shape, [w.join for w in self._workers.values()])
        self._left = 0
        for w in self._workers.values():
            w.rank = node_ranks[w.join.node_id] * lws + w.join.local_rank
            w.state = RankState.RUNNING
            w.last_seen = now  # building the peer mesh comes next; the clock starts here
        # by rank: of workers silent equally long, the lowest rank is named
        self._beats = {w.conn: None for w in sorted(self._workers.values(), key=lambda w: w.rank)}
        self.state = JobState.RUNNING
        self._deadline = None
        nodes = sum(1 for a in self._agents.values() if a.node_rank is not None)
        self.gens.begin(shape.world_size, nodes, now)
        self.stragglers = Stragglers()  # sequences start again with the generation
        self.links = LinkTable()  # so do connections and their totals
        self._event(
            f"all {shape.world_size} workers joined; job running (generation {self.generation})",
            now,
        )
        self._members, actions = placements(
            self._workers.values(), shape, self.generation, grace=self.config.grace
        )
        self._by_rank = {w.rank: w for w in self._workers.values()}
        self._requested = {}
        if self._may_grow() and any(a.node_rank is None for a in self._agents.values()):
            # a node arrived while this generation formed: take it in with the next one
            late = next(a for a in self._agents.values() if a.node_rank is None)
            actions += self._end_generation(-1, f"node {late.join.node_id!r} joined", failure=False)
        return actions

    def peer_page(self, conn: ConnId, msg: PeerQuery) -> list[Action]:
        """The members with the asked ranks, of the asking worker's generation."""
        worker = self._workers.get(conn)
        if worker is None or worker.rank < 0 or not self._members:
            return refuse(conn, "bad_request", "members are asked by a worker of a formed job")
        world = len(self._members)
        if any(r >= world for r in msg.ranks):
            return refuse(conn, "bad_request", f"asked for ranks beyond the world of {world}")
        members = [self._members[r] for r in msg.ranks]
        return [Send(conn, PeerPage(generation=self.generation, members=members))]

    def report_failure(self, conn: ConnId, msg: Failure, now: float) -> list[Action]:
        worker = self._workers.get(conn)
        self._now = now
        if worker is None or worker.rank < 0:
            return []
        if self.state is JobState.FAILING:
            return self._testify(worker, msg.diagnosis, now)
        if msg.rank >= 0 and msg.rank != worker.rank:
            blamed = self._by_rank.get(msg.rank)
            if blamed is None or self._workers.get(blamed.conn) is not blamed:
                return []
            reason = f"{msg.reason} (reported by rank {worker.rank})"
            return self._fail(blamed, reason)
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
        reason, records = verdict.reason, []
        if self.config.inquest_dir:  # the summary names the file with everything
            name = f"{self.config.run_id}-generation-{self.generation}-inquest.json"
            path = f"{self.config.inquest_dir.rstrip('/')}/{name}"
            reason += f"; every rank's place, stack and recent collectives: {path}"
            records.append(Record(path, verdict.detail))
        return records + self._abort(verdict.rank, reason, stacks=verdict.stacks)

    def leave(self, conn: ConnId, msg: Leave) -> list[Action]:
        worker = self._workers.get(conn)
        if worker is None or worker.state is not RankState.RUNNING:
            return []
        worker.state = RankState.LEFT
        self._left += 1  # counted, not scanned: a thousand leaves stay linear
        self._event(f"rank {worker.rank} finished")
        if self.state is JobState.RUNNING and self._left == len(self._workers):
            self.state = JobState.FINISHED
            self.gens.end("finished", self._now)
            self._event("job finished")
            return [Send(a, Finished(generation=self.generation)) for a in self._agents]
        return []

    def _unpark(self, now: float) -> list[Action]:
        parked, self._parked = self._parked, {}
        actions: list[Action] = []
        for conn, (msg, host) in parked.items():
            actions += self.join(conn, msg, peer_host=host, now=now)
        return actions

    def disconnected(self, conn: ConnId) -> list[Action]:
        if self._parked.pop(conn, None) is not None:
            return []
        agent = self._agents.pop(conn, None)
        if agent is not None:
            return self._agent_lost(agent)
        if self._old.pop(conn, None) is not None:
            return self._advance(self._now)
        worker = self._workers.get(conn)
        if worker is None:
            return []
        if self.state is JobState.WAITING:
            del self._workers[conn]
            self._joins.remove(worker.join, worker.join.local_world_size)
            asked = worker.join.requested_rank
            if asked is not None and self._requested.get(asked) is worker:
                del self._requested[asked]
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
        expired = self._deadline is not None and now > self._deadline
        if self.state is JobState.WAITING:
            if expired:
                return self._join_timeout()
            return self._advance(now)
        if self.state is JobState.RESTARTING:
            if expired:
                return self._give_up("the processes of the ended generation did not all exit")
            return self._advance(now)
        if self.state is JobState.FAILING:
            return self._conclude(now)
        if self.state is not JobState.RUNNING:
            return []
        return self._silent(now)

    def _join_timeout(self) -> list[Action]:
        message = f"join timeout after {self.config.join_timeout:g} s: {self.missing()}"
        self._event(message)
        if self.generation > 1:  # a restart that never formed: the job is over
            return self._give_up(message) + [Close(c) for c in self._workers]
        conns = list(self._workers) + list(self._agents)
        self._workers.clear()
        self._joins = JoinIndex()
        self._members = []
        self._by_rank = {}
        self._requested = {}
        self._agents.clear()
        self._deadline = None
        self._last_call = None
        self._world = None
        self._shape = None
        actions: list[Action] = []
        for conn in conns:
            actions += refuse(conn, "join_timeout", message)
        return actions

    def missing(self) -> str:
        """Describe who has not joined yet (used in timeout errors and status)."""
        joins = [w.join for w in self._workers.values()]
        return describe_missing(self.shape, joins, agents=len(self._agents))

    def status(self, now: float, offset: int = 0, limit: int | None = None) -> StatusReply:
        """The job as a monitoring client sees it (rank rows ``offset`` onwards, at most
        ``limit``; None: all, for the status page)."""
        return status_reply(self, now, offset, limit)
