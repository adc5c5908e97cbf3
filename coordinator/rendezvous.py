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

from collections import deque

from shardwire.coordinator.diagnosis import Inquest
from shardwire.coordinator.generations import Generations
from shardwire.coordinator.journal import Journal
from shardwire.coordinator.lifecycle import Lifecycle
from shardwire.coordinator.linktable import LinkTable
from shardwire.coordinator.liveness import Liveness
from shardwire.coordinator.membership import (
    Shape,
)
from shardwire.coordinator.progress import Curves
from shardwire.coordinator.recovery import Recovery
from shardwire.coordinator.state import (
    Action,
    ConnId,
    FailureRecord,
    JobState,
    RankState,
    Record,
    RendezvousConfig,
    Send,
    Worker,
    refuse,
)
from shardwire.coordinator.stragglers import Stragglers
from shardwire.coordinator.views import status_reply
from shardwire.protocol.beats import Heartbeat, NodeBeat
from shardwire.protocol.messages import (
    DiagnoseReply,
    DiagnoseRequest,
    Diagnosis,
    Failure,
    Join,
    Leave,
    NodeJoin,
    NodeRejoin,
    Rejoin,
    StatusReply,
)
from shardwire.protocol.placement import PeerPage, PeerQuery


class Rendezvous:
    """One job's membership, rank assignment and liveness, generation after generation:
    the job (its state and transitions), its liveness and its recovery, each input
    handed to the part it concerns."""

    def __init__(self, config: RendezvousConfig) -> None:
        self.job = Lifecycle(config)
        self.liveness = Liveness(self.job)
        self.recovery = Recovery(self.job)

    # ---- what the job is (read by the server, the status views and /metrics) ----------

    @property
    def config(self) -> RendezvousConfig:
        return self.job.config

    @property
    def state(self) -> JobState:
        return self.job.state

    @property
    def failure(self) -> FailureRecord | None:
        return self.job.failure

    @property
    def inquest(self) -> Inquest | None:
        return self.job.inquest

    @property
    def gens(self) -> Generations:
        return self.job.gens

    @property
    def generation(self) -> int:
        return self.job.generation

    @property
    def shape(self) -> Shape | None:
        return self.job.shape

    @property
    def workers(self) -> list[Worker]:
        return self.job.workers

    def worker_of(self, rank: int) -> Worker | None:
        return self.job.worker_of(rank)

    def rows(self, offset: int = 0, limit: int | None = None) -> tuple[list[Worker], int]:
        return self.job.rows(offset, limit)

    @property
    def events(self) -> deque[tuple[float, str]]:
        return self.job.events

    @property
    def curves(self) -> Curves:
        return self.job.curves

    @property
    def stragglers(self) -> Stragglers:
        return self.job.stragglers

    @property
    def links(self) -> LinkTable:
        return self.job.links

    @property
    def beats_via(self) -> dict[str, int]:
        return self.liveness.beats_via

    @property
    def assigned(self) -> bool:
        return self.job.assigned

    @property
    def between(self) -> bool:
        return self.job.between

    def missing(self) -> str:
        return self.job.missing()

    # ---- inputs ------------------------------------------------------------------------

    def node_join(self, conn: ConnId, msg: NodeJoin, now: float) -> list[Action]:
        return self.job.node_join(conn, msg, now)

    def join(self, conn: ConnId, msg: Join, *, peer_host: str, now: float) -> list[Action]:
        return self.job.join(conn, msg, peer_host=peer_host, now=now)

    def leave(self, conn: ConnId, msg: Leave) -> list[Action]:
        return self.job.leave(conn, msg)

    def heartbeat(self, conn: ConnId, msg: Heartbeat, now: float) -> list[Action]:
        return self.liveness.heartbeat(conn, msg, now)

    def node_beat(self, conn: ConnId, msg: NodeBeat, now: float) -> list[Action]:
        return self.liveness.node_beat(conn, msg, now)

    def beating(self, conn: ConnId) -> bool:
        return self.liveness.beating(conn)

    def rejoin(self, conn: ConnId, msg: Rejoin, now: float) -> list[Action]:
        return self.recovery.rejoin(conn, msg, now)

    def node_rejoin(self, conn: ConnId, msg: NodeRejoin, now: float) -> list[Action]:
        return self.recovery.node_rejoin(conn, msg, now)

    def journal(self) -> Journal | None:
        return self.recovery.journal()

    def restore(self, journal: Journal, now: float, *, since_written: float = 0.0) -> None:
        self.recovery.restore(journal, now, since_written=since_written)

    def peer_page(self, conn: ConnId, msg: PeerQuery) -> list[Action]:
        """The members with the asked ranks, of the asking worker's generation."""
        worker = self.job.joined.get(conn)
        if worker is None or worker.rank < 0 or not self.job.members:
            return refuse(conn, "bad_request", "members are asked by a worker of a formed job")
        world = len(self.job.members)
        if any(r >= world for r in msg.ranks):
            return refuse(conn, "bad_request", f"asked for ranks beyond the world of {world}")
        members = [self.job.members[r] for r in msg.ranks]
        return [Send(conn, PeerPage(generation=self.job.generation, members=members))]

    def report_failure(self, conn: ConnId, msg: Failure, now: float) -> list[Action]:
        worker = self.job.joined.get(conn)
        self.job.now = now
        if worker is None or worker.rank < 0:
            return []
        if self.job.state is JobState.FAILING:
            return self._testify(worker, msg.diagnosis, now)
        if msg.rank >= 0 and msg.rank != worker.rank:
            blamed = self.job.by_rank.get(msg.rank)
            if blamed is None or self.job.joined.get(blamed.conn) is not blamed:
                return []
            reason = f"{msg.reason} (reported by rank {worker.rank})"
            return self.job.fail(blamed, reason)
        if msg.code == "collective_timeout" and self.job.state is JobState.RUNNING:
            return self._open_inquest(worker, msg, now)
        return self.job.fail(worker, msg.reason, msg.traceback)

    def _open_inquest(self, worker: Worker, msg: Failure, now: float) -> list[Action]:
        worker.state = RankState.FAILED
        self.job.state = JobState.FAILING
        self.job.event(f"rank {worker.rank}: {msg.reason}; asking every rank what it is doing")
        live = [w for w in self.job.joined.values() if w.state is RankState.RUNNING]
        self.job.inquest = Inquest(
            reporter=worker.rank,
            reason=msg.reason,
            deadline=now + self.job.config.diagnose_timeout,
            asked={w.rank for w in live},
        )
        self.job.inquest.add(worker.rank, msg.diagnosis)
        return [Send(w.conn, DiagnoseRequest()) for w in live] + self._conclude(now)

    def diagnosis(self, conn: ConnId, msg: DiagnoseReply, now: float) -> list[Action]:
        worker = self.job.joined.get(conn)
        self.job.now = now
        if worker is None or self.job.state is not JobState.FAILING:
            return []
        return self._testify(worker, msg.diagnosis, now)

    def _testify(self, worker: Worker, diagnosis: Diagnosis | None, now: float) -> list[Action]:
        assert self.job.inquest is not None
        if worker.state is RankState.RUNNING and diagnosis is None:
            worker.state = RankState.FAILED  # it failed too, without saying more
        self.job.inquest.add(worker.rank, diagnosis)
        return self._conclude(now)

    def _conclude(self, now: float) -> list[Action]:
        inquest = self.job.inquest
        if inquest is None or not inquest.complete(now):
            return []
        assert self.job.job_shape is not None
        verdict = inquest.verdict(self.job.job_shape.world_size)
        self.job.inquest = None
        reason, records = verdict.reason, []
        if self.job.config.inquest_dir:  # the summary names the file with everything
            name = f"{self.job.config.run_id}-generation-{self.job.generation}-inquest.json"
            path = f"{self.job.config.inquest_dir.rstrip('/')}/{name}"
            reason += f"; every rank's place, stack and recent collectives: {path}"
            records.append(Record(path, verdict.detail))
        return records + self.job.abort(verdict.rank, reason, stacks=verdict.stacks)

    def disconnected(self, conn: ConnId) -> list[Action]:
        if self.job.parked.pop(conn, None) is not None:
            return []
        agent = self.job.agents.pop(conn, None)
        if agent is not None:
            return self.job.agent_lost(agent)
        if self.job.old.pop(conn, None) is not None:
            return self.job.advance(self.job.now)
        worker = self.job.joined.get(conn)
        if worker is None:
            return []
        if self.job.state is JobState.WAITING:
            self.job.withdraw(worker)
            return []
        worker.connected = False
        if self.job.inquest is not None:
            worker.state = RankState.FAILED
            self.job.inquest.add(worker.rank, None)
            return self._conclude(self.job.now)
        if worker.state is RankState.RUNNING:
            return self.job.fail(worker, "connection to the coordinator closed (process died?)")
        return []

    def tick(self, now: float) -> list[Action]:
        self.job.now = now
        expired = self.job.deadline is not None and now > self.job.deadline
        if self.job.state is JobState.WAITING:
            if expired:
                return self.job.join_timeout()
            return self.job.advance(now)
        if self.job.state is JobState.RESTARTING:
            if expired:
                return self.job.give_up("the processes of the ended generation did not all exit")
            return self.job.advance(now)
        if self.job.state is JobState.FAILING:
            return self._conclude(now)
        if self.job.state is not JobState.RUNNING:
            return []
        return self.liveness.silent(now)

    def status(self, now: float, offset: int = 0, limit: int | None = None) -> StatusReply:
        """The job as a monitoring client sees it (rank rows ``offset`` onwards, at most
        ``limit``; None: all, for the status page)."""
        return status_reply(self, now, offset, limit)
