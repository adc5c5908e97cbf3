"""A coordinator that may die (pure): its journal of the running generation, and taking
the job back from it.

Theory of operation
-------------------
The data plane does not need the coordinator from step to step, so its absence is a
pause in supervision, not the end of the job. A coordinator with a state directory tells
every worker and agent, in their placement, how long to wait for it (``grace``) and
journals each formed generation (:meth:`Recovery.journal`). Killed and started again on
the same directory and address, it restores that generation (:meth:`Recovery.restore`):
the same ranks, members and node ranks, every worker and agent known but not yet
connected. Liveness judgments are suspended for the grace: a placeholder's heartbeat
clock starts ``grace`` in the future. Workers and agents reconnect on their own with
backoff and say who they are (``Rejoin``, ``NodeRejoin``); each is checked against the
journal and bound to its new connection, and its heartbeats count again. One that does
not come back within the grace is judged as any silent rank is: the generation ends and
the restart budget decides.
"""

from __future__ import annotations

from shardwire.coordinator.forming import member
from shardwire.coordinator.generations import Era
from shardwire.coordinator.journal import Journal, JournalEra, JournalNode, JournalWorker
from shardwire.coordinator.lifecycle import Lifecycle
from shardwire.coordinator.membership import JoinIndex, Shape
from shardwire.coordinator.state import (
    Action,
    Agent,
    ConnId,
    FailureRecord,
    JobState,
    RankState,
    Send,
    Worker,
    refuse,
)
from shardwire.protocol.messages import Finished, NodeRejoin, Rejoin, Rejoined


class Recovery:
    """A job's journal, and taking the job back from it."""

    def __init__(self, job: Lifecycle) -> None:
        self.job = job

    def journal(self) -> Journal | None:
        """The running generation as a restarted coordinator resumes it, the forming one
        whose nodes were assigned, or the restart between two (None before the first
        generation is assigned, and once the job is over)."""
        forming = self.job.state is JobState.WAITING and self.job.assigned
        restart = self.job.last_restart if self.job.between else None
        usable = self.job.state is JobState.RUNNING or forming or restart is not None
        if not usable or self.job.job_shape is None:
            return None
        shape = self.job.generation_shape()
        return Journal(
            forming=forming,
            restart=restart,
            rejoining=[a.join for a in self.job.agents.values() if restart and a.node_rank is None],
            run_id=self.job.config.run_id,
            generation=self.job.generation,
            restarts=self.job.gens.restarts,
            max_restarts=self.job.gens.max_restarts,
            world_size=shape.world_size,
            local_world_size=shape.local_world_size,
            min_nodes=self.job.job_shape.min_nodes,
            workers=[]  # while it forms, the workers joined so far join again
            if forming
            else [
                JournalWorker(rank=w.rank, host=w.host, join=w.join)
                for w in sorted(self.job.joined.values(), key=lambda w: w.rank)
            ],
            nodes=[
                JournalNode(node_rank=a.node_rank, join=a.join)
                for a in self.job.agents.values()
                if a.node_rank is not None
            ],
            history=[
                JournalEra(
                    generation=e.generation,
                    world_size=e.world_size,
                    nodes=e.nodes,
                    started_ago_s=max(0.0, self.job.now - e.started),
                    duration_s=None if e.ended is None else e.ended - e.started,
                    ended_by=e.ended_by[:256],
                )
                for e in self.job.gens.eras
            ],
        )

    def restore(self, journal: Journal, now: float, *, since_written: float = 0.0) -> None:
        """Take the journal's generation back as RUNNING (or forming); its workers and
        agents have ``config.grace`` seconds to reconnect. ``since_written``: seconds
        from the journal's writing to ``now`` (its history's ages grow by that)."""
        grace = self.job.config.grace
        self.job.now = now
        self.job.gens.eras = [_era(e, now - since_written) for e in journal.history]
        lws = journal.local_world_size
        self.job.job_shape = Shape(journal.world_size, lws, journal.min_nodes)
        self.job.world = journal.world_size
        self.job.gens.current = journal.generation
        self.job.gens.restarts = journal.restarts
        self.job.gens.max_restarts = journal.max_restarts
        self.job.join_index = JoinIndex()
        for node in journal.nodes:
            key = ("journal-node", node.join.node_id)
            self.job.agents[key] = Agent(key, node.join, node_rank=node.node_rank)
        if journal.restart is not None:
            self._restore_restart(journal, now)
            return
        if journal.forming:  # its workers join as they would have: it forms again
            self.job.state = JobState.WAITING
            self.job.deadline = now + grace + self.job.config.join_timeout
            self.job.event(
                f"coordinator restarted from its journal while generation {journal.generation} "
                f"formed; its {len(journal.nodes)} node(s) reconnect and its workers join "
                f"within {grace:g} s",
                now,
            )
            return
        if not self.job.gens.eras or self.job.gens.eras[-1].generation != journal.generation:
            self.job.gens.begin(journal.world_size, len(journal.nodes), now)
        # the heartbeat clock of a worker not yet back runs out ``grace`` from now
        silent_from = now + grace - self.job.config.heartbeat_timeout
        for jw in journal.workers:
            worker = Worker(
                ("journal", jw.rank),
                jw.join,
                jw.host,
                silent_from,
                rank=jw.rank,
                state=RankState.RUNNING,
                connected=False,
            )
            self.job.joined[worker.conn] = worker
            self.job.by_rank[jw.rank] = worker
            self.job.beat_order[worker.conn] = None
            self.job.join_index.add(jw.join, lws)
        self.job.members = [member(self.job.by_rank[jw.rank], lws) for jw in journal.workers]
        self.job.state = JobState.RUNNING
        self.job.deadline = None
        self.job.event(
            f"coordinator restarted from its journal: generation {journal.generation} of "
            f"{journal.world_size} ranks; waiting up to {grace:g} s for them to reconnect",
            now,
        )

    def _restore_restart(self, journal: Journal, now: float) -> None:
        """Between generations: the agents rejoin, hear the restart (again, or for the
        first time), and send their NodeJoin for the next generation as they would have."""
        restart = journal.restart
        assert restart is not None
        self.job.world = None
        self.job.last_restart = restart
        for join in journal.rejoining:
            key = ("journal-node", join.node_id)
            self.job.agents[key] = Agent(key, join, node_rank=None, ready=False)
        self.job.failure = (
            FailureRecord(restart.rank, restart.reason) if restart.rank >= 0 else None
        )
        self.job.state = JobState.RESTARTING
        self.job.deadline = now + self.job.config.grace + self.job.config.join_timeout
        self.job.event(
            f"coordinator restarted from its journal while the job restarted: generation "
            f"{journal.generation} forms once its {len(journal.rejoining)} node(s) are back",
            now,
        )

    def rejoin(self, conn: ConnId, msg: Rejoin, now: float) -> list[Action]:
        """A worker back after losing its coordinator: bound to its new connection."""
        self.job.now = now
        worker = self.job.by_rank.get(msg.rank)
        problem = self._rejoin_problem(msg.generation, f"rank {msg.rank}")
        if problem is None and (worker is None or worker.connected):
            problem = f"rank {msg.rank} is not waiting to reconnect"
        if (
            problem is None
            and worker is not None
            and (
                worker.join.node_id != msg.join.node_id
                or worker.join.local_rank != msg.join.local_rank
            )
        ):
            problem = (
                f"rank {msg.rank} is node {worker.join.node_id!r} local rank "
                f"{worker.join.local_rank} here, not node {msg.join.node_id!r} local rank "
                f"{msg.join.local_rank}"
            )
        if problem is not None or worker is None:
            return refuse(conn, "rejoin", problem or "")
        del self.job.joined[worker.conn]
        self.job.beat_order.pop(worker.conn, None)
        worker.conn, worker.connected, worker.last_seen = conn, True, now
        self.job.joined[conn] = worker
        self.job.beat_order[conn] = None  # the newest heartbeat
        self.job.event(f"rank {msg.rank} reconnected", now)
        return [Send(conn, Rejoined(generation=self.job.generation))]

    def node_rejoin(self, conn: ConnId, msg: NodeRejoin, now: float) -> list[Action]:
        """A node agent back after losing its coordinator."""
        self.job.now = now
        key = ("journal-node", msg.join.node_id)
        agent = self.job.agents.get(key)
        who = f"node {msg.join.node_id!r}"
        # the job finished while this agent was away (its ranks took the coordinator back
        # and left): it hears so, as it would have
        done = self.job.state is JobState.FINISHED and msg.generation == self.job.generation
        # restored between generations: an agent of an earlier one hears of the restart
        restart = self.job.last_restart if self.job.state is JobState.RESTARTING else None
        between = restart is not None and msg.generation < self.job.generation
        if between:
            problem = None if agent is not None else f"{who} is not waited for"
        else:
            problem = None if done else self._rejoin_problem(msg.generation, who)
            if problem is None and (agent is None or agent.node_rank != msg.node_rank):
                problem = f"{who} (node rank {msg.node_rank}) is not waited for"
        if problem is not None or agent is None:
            return refuse(conn, "rejoin", problem or "")
        del self.job.agents[key]
        agent.conn = conn
        self.job.agents[conn] = agent
        self.job.event(f"{who} reconnected", now)
        back: list[Action] = [Send(conn, Rejoined(generation=self.job.generation))]
        if between and restart is not None:
            back.append(Send(conn, restart))
        return back + ([Send(conn, Finished(generation=self.job.generation))] if done else [])

    def _rejoin_problem(self, generation: int, who: str) -> str | None:
        forming = self.job.state is JobState.WAITING and self.job.assigned  # agents only: no worker
        if self.job.state is not JobState.RUNNING and not forming:  # was placed while it formed
            return f"{who} cannot rejoin: the job is {self.job.state.value}"
        if generation != self.job.generation:
            return f"{who} is of generation {generation}; the job is at {self.job.generation}"
        return None


def _era(e: JournalEra, written: float) -> Era:
    """A journaled generation on this clock (``written``: when the journal was written)."""
    started = written - e.started_ago_s
    ended = None if e.duration_s is None else started + e.duration_s
    return Era(e.generation, e.world_size, e.nodes, started, ended, e.ended_by)
