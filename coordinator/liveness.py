"""Liveness of a running generation (pure): heartbeats, a worker's own or batched by
its node's agent, and the silent-worker rule.

A running worker's heartbeat refreshes its ``last_seen`` and moves it to the end of
``beat_order`` (oldest first), so the tick reads only the head of that order to find the
workers silent for longer than ``heartbeat_timeout``; of those, the lowest rank is named.
A node beat from an agent applies each entry as that rank's own heartbeat, only for
ranks of the agent's node in the current generation (while it forms, the rank each of
its workers asked for; agents' workers always ask).
"""

from __future__ import annotations

from shardwire.coordinator.forming import stall_text
from shardwire.coordinator.lifecycle import Lifecycle
from shardwire.coordinator.state import (
    Action,
    ConnId,
    JobState,
    Notice,
    RankState,
    Worker,
)
from shardwire.protocol.beats import Heartbeat, NodeBeat


class Liveness:
    """Heartbeats and the silent-worker rule, over a job's running generation."""

    def __init__(self, job: Lifecycle) -> None:
        self.job = job
        # heartbeats applied, by how they came: from the worker, or batched by its agent
        self.beats_via: dict[str, int] = {"worker": 0, "agent": 0}

    def heartbeat(self, conn: ConnId, msg: Heartbeat, now: float) -> list[Action]:
        worker = self.job.joined.get(conn)
        self.job.now = now
        if worker is None:
            return []
        self.beats_via["worker"] += 1
        return self._beat(worker, msg, now)

    def node_beat(self, conn: ConnId, msg: NodeBeat, now: float) -> list[Action]:
        """An agent's batch of its workers' heartbeats: each applies as the rank's own,
        for ranks of the agent's node in the current generation (others are dropped: an
        entry of an ended generation, or of a rank the agent does not speak for)."""
        self.job.now = now
        agent = self.job.agents.get(conn)
        if agent is None:  # not (or no longer) an agent of this job: nothing to apply
            return []
        actions: list[Action] = []
        node = agent.join.node_id
        forming = self.job.state is JobState.WAITING
        for entry in msg.beats:
            worker = (self.job.requested if forming else self.job.by_rank).get(entry.rank)
            if (
                worker is None
                or entry.generation != self.job.generation
                or worker.join.node_id != node
                or worker.conn not in self.job.joined
            ):
                continue
            self.beats_via["agent"] += 1
            actions += self._beat(worker, entry.beat, now)
        return actions

    def beating(self, conn: ConnId) -> bool:
        """Whether ``conn`` is a worker whose liveness is watched without its own
        connection's messages (its heartbeats may come through its node's agent): a
        running one, by its heartbeats; a joined one, by the join deadline."""
        worker = self.job.joined.get(conn)
        return worker is not None and worker.state in (RankState.RUNNING, RankState.JOINED)

    def _beat(self, worker: Worker, msg: Heartbeat, now: float) -> list[Action]:
        conn = worker.conn
        worker.last_seen = now
        self.job.beat_order.pop(conn, None)
        self.job.beat_order[conn] = None  # now the newest
        if worker.rank == 0:
            self.job.curves.add(now, worker.progress, msg)
        if msg.timings or msg.links:
            self.job.stragglers.add(worker.rank, msg.timings)
            self.job.links.add(worker.rank, msg.links)
            msg = msg.model_copy(update={"timings": [], "links": []})
        before, worker.progress = worker.progress, msg
        return self._stall_notice(worker, before)

    def _stall_notice(self, worker: Worker, before: Heartbeat) -> list[Action]:
        who = f"rank {worker.rank}" if worker.rank >= 0 else f"worker on {worker.join.node_id}"
        text = stall_text(who, before, worker.progress)
        if text is None:
            return []
        self.job.event(text)
        return [Notice(text)]

    def silent(self, now: float) -> list[Action]:
        """Fail the lowest rank among those whose heartbeat is overdue; looks only at the
        oldest heartbeats (the head of ``beat_order``), not at every worker."""
        limit, overdue, gone = self.job.config.heartbeat_timeout, [], []
        for conn in self.job.beat_order:
            w = self.job.joined.get(conn)
            if w is None or w.state is not RankState.RUNNING:
                gone.append(conn)
            elif now - w.last_seen > limit:
                overdue.append(w)
            else:
                break
        for conn in gone:
            del self.job.beat_order[conn]
        if not overdue:
            return []
        w = min(overdue, key=lambda w: w.rank)
        silent = now - w.last_seen
        return self.job.fail(w, f"no heartbeat for {silent:.1f} s (hung or partitioned)")
