"""A coordinator that may die: its journal of the running generation, a restarted one
taking the job back from it (pure), and the state directory's refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardwire.coordinator import JobState, Rendezvous, RendezvousConfig, Send
from shardwire.coordinator.journal import Journal, JournalEra, StateDir, StateDirError
from shardwire.protocol.messages import (
    Abort,
    Failure,
    Finished,
    Heartbeat,
    Leave,
    NodeAssignment,
    NodeJoin,
    NodeRejoin,
    Rejoin,
    Rejoined,
    Restart,
)
from shardwire.protocol.placement import PeerPage, PeerQuery, Placement
from tests.coordinator.test_rendezvous import error_of, join, rosters

GRACE = 30.0


def _formed(grace: float = GRACE) -> tuple[Rendezvous, dict[int, Placement]]:
    r = Rendezvous(RendezvousConfig(run_id="r", world_size=4, grace=grace, heartbeat_timeout=5))
    places: dict[int, Placement] = {}
    for conn, msg in {1: join("a", 0), 2: join("a", 1), 3: join("b", 0), 4: join("b", 1)}.items():
        places |= rosters(r.join(conn, msg, peer_host="10.0.0.9", now=0.0))
    return r, places


def _restored(now: float = 100.0) -> tuple[Rendezvous, Journal]:
    before, _ = _formed()
    journal = before.journal()
    assert journal is not None
    again = Rendezvous(RendezvousConfig(run_id="r", world_size=4, grace=GRACE, heartbeat_timeout=5))
    again.restore(Journal.model_validate_json(journal.model_dump_json()), now)
    return again, journal


def test_placements_tell_the_grace_and_the_journal_holds_the_generation() -> None:
    r, places = _formed()
    assert {p.grace for p in places.values()} == {GRACE}
    journal = r.journal()
    assert journal is not None and journal.generation == 1 and journal.world_size == 4
    assert [(w.rank, w.join.node_id, w.join.local_rank) for w in journal.workers] == [
        (0, "a", 0),
        (1, "a", 1),
        (2, "b", 0),
        (3, "b", 1),
    ]
    without, _ = _formed(grace=0.0)
    assert without.journal() is not None  # journaled only where the server has a directory


def test_a_restored_coordinator_takes_each_rank_back_on_its_new_connection() -> None:
    r, journal = _restored()
    assert r.state is JobState.RUNNING and r.generation == 1
    for rank, jw in enumerate(journal.workers):
        got = r.rejoin(50 + rank, Rejoin(rank=rank, generation=1, join=jw.join), now=101.0)
        assert got == [Send(50 + rank, Rejoined(generation=1))]
    (page,) = [a.msg for a in r.peer_page(52, PeerQuery(ranks=[3, 0]))]
    assert isinstance(page, PeerPage)
    assert [(m.rank, m.node_id, m.port) for m in page.members] == [(3, "b", 1001), (0, "a", 1000)]
    assert r.heartbeat(51, Heartbeat(step=7), now=102.0) == []
    assert r.worker_of(1) is not None and r.worker_of(1).progress.step == 7  # type: ignore[union-attr]


def test_liveness_waits_the_grace_for_ranks_that_are_not_back() -> None:
    r, journal = _restored(now=100.0)
    for rank in (0, 2, 3):
        r.rejoin(rank + 10, Rejoin(rank=rank, generation=1, join=journal.workers[rank].join), 100.5)
    for t in (101.0, 110.0, 129.0):  # the others beat; rank 1 has the grace
        for rank in (0, 2, 3):
            r.heartbeat(rank + 10, Heartbeat(), now=t)
        assert r.tick(t) == [] and r.state is JobState.RUNNING
    for rank in (0, 2, 3):
        r.heartbeat(rank + 10, Heartbeat(), now=131.0)
    actions = r.tick(131.0)
    aborts = [a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, Abort)]
    assert aborts and aborts[0].rank == 1 and "no heartbeat" in aborts[0].reason
    assert r.state is JobState.FAILED


@pytest.mark.parametrize(
    ("rank", "generation", "node", "words"),
    [
        (1, 2, "a", "rank 1 is of generation 2; the job is at 1"),
        (1, 1, "b", "rank 1 is node 'a' local rank 1 here, not node 'b' local rank 1"),
        (7, 1, "a", "rank 7 is not waiting to reconnect"),
    ],
)
def test_a_rejoin_that_does_not_match_the_journal_is_refused(rank, generation, node, words):
    r, journal = _restored()
    asked = journal.workers[1].join.model_copy(update={"node_id": node})
    error = error_of(r.rejoin(9, Rejoin(rank=rank, generation=generation, join=asked), 101.0))
    assert error.code == "rejoin" and words in error.message


def test_a_rank_is_taken_back_once() -> None:
    r, journal = _restored()
    msg = Rejoin(rank=0, generation=1, join=journal.workers[0].join)
    assert isinstance(r.rejoin(9, msg, 101.0)[0].msg, Rejoined)  # type: ignore[union-attr]
    assert "not waiting to reconnect" in error_of(r.rejoin(10, msg, 101.0)).message


def test_node_agents_are_taken_back_by_node_id_and_node_rank() -> None:
    r = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE))
    agents = {
        1: NodeJoin(world_size=2, node_id="a", local_world_size=1),
        2: NodeJoin(world_size=2, node_id="b", local_world_size=1),
    }
    sent = []
    for conn, msg in agents.items():
        sent += r.node_join(conn, msg, 0.0)
    ranks = {a.conn: a.msg.node_rank for a in sent if isinstance(a.msg, NodeAssignment)}
    assert {a.msg.grace for a in sent if isinstance(a.msg, NodeAssignment)} == {GRACE}
    for conn, rank in ranks.items():
        w = join(agents[conn].node_id, 0, world=2, lws=1, rank=rank)
        r.join(conn + 10, w, peer_host="10.0.0.9", now=0.0)
    journal = r.journal()
    assert journal is not None and sorted(n.node_rank for n in journal.nodes) == [0, 1]
    again = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE))
    again.restore(journal, 50.0)
    back = again.node_rejoin(7, NodeRejoin(node_rank=ranks[2], generation=1, join=agents[2]), 51)
    assert back == [Send(7, Rejoined(generation=1))]
    wrong = NodeRejoin(node_rank=ranks[2], generation=1, join=agents[1])
    assert "is not waited for" in error_of(again.node_rejoin(8, wrong, 51)).message
    # the ranks came back and finished before node a's agent did: it hears the job is done
    for conn, rank in ranks.items():
        w = join(agents[conn].node_id, 0, world=2, lws=1, rank=rank)
        again.rejoin(conn + 30, Rejoin(rank=rank, generation=1, join=w), 52.0)
        again.leave(conn + 30, Leave())
    assert again.state is JobState.FINISHED
    late = NodeRejoin(node_rank=ranks[1], generation=1, join=agents[1])
    assert again.node_rejoin(9, late, 53.0) == [
        Send(9, Rejoined(generation=1)),
        Send(9, Finished(generation=1)),
    ]
    stale = NodeRejoin(node_rank=ranks[1], generation=2, join=agents[1])
    assert error_of(again.node_rejoin(10, stale, 53.0)).code == "rejoin"


def test_a_coordinator_killed_while_the_job_formed_takes_the_nodes_back_and_forms_it() -> None:
    """The nodes were assigned, one worker had joined: the journal holds the forming
    generation (its nodes, no worker); a restarted coordinator takes the agents back and
    the workers, joining again, form that same generation."""
    r = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE))
    agents = {
        1: NodeJoin(world_size=2, node_id="a", local_world_size=1),
        2: NodeJoin(world_size=2, node_id="b", local_world_size=1),
    }
    assert r.journal() is None  # nothing assigned yet: a restart starts afresh
    sent = [a for conn, msg in agents.items() for a in r.node_join(conn, msg, 0.0)]
    ranks = {a.conn: a.msg.node_rank for a in sent if isinstance(a.msg, NodeAssignment)}
    workers = {c: join(agents[c].node_id, 0, world=2, lws=1, rank=ranks[c]) for c in agents}
    r.join(11, workers[1], peer_host="10.0.0.9", now=0.5)
    journal = r.journal()
    assert journal is not None and journal.forming and journal.workers == []
    assert sorted(n.node_rank for n in journal.nodes) == [0, 1] and journal.generation == 1
    again = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE))
    again.restore(Journal.model_validate_json(journal.model_dump_json()), 50.0)
    assert again.state is JobState.WAITING and again.generation == 1
    assert "while generation 1 formed" in again.events[-1][1]
    for conn, agent in agents.items():
        back = NodeRejoin(node_rank=ranks[conn], generation=1, join=agent)
        assert again.node_rejoin(conn + 20, back, 51.0) == [Send(conn + 20, Rejoined(generation=1))]
    assert again.tick(52.0) == []  # no node is assigned twice
    assert again.join(31, workers[1], peer_host="10.0.0.9", now=52.0) == []
    places = rosters(again.join(32, workers[2], peer_host="10.0.0.9", now=52.5))
    assert {p.rank for p in places.values()} == set(ranks.values()) and again.generation == 1
    assert again.state is JobState.RUNNING
    running = again.journal()
    assert running is not None and not running.forming and len(running.workers) == 2
    worker = Rejoin(rank=0, generation=1, join=workers[1])  # no worker was placed: none back
    fresh = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE))
    fresh.restore(journal, 60.0)
    assert "not waiting to reconnect" in error_of(fresh.rejoin(9, worker, 61.0)).message


def test_the_state_directory_round_trips_the_journal_and_is_held_by_one(tmp_path) -> None:
    r, _ = _formed()
    journal = r.journal()
    assert journal is not None
    state = StateDir(tmp_path / "state", "r")
    state.open()
    try:
        assert state.read() is None
        state.write(journal)
        assert state.read() == journal
        other = StateDir(tmp_path / "state", "r")
        with pytest.raises(
            StateDirError, match=f"held by another live coordinator \\(PID {os.getpid()} on"
        ):
            other.open()
        state.remove()
        assert state.read() is None
    finally:
        state.close()


@pytest.mark.e2e
def test_a_live_coordinator_in_another_process_holds_its_directory(tmp_path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from shardwire.coordinator.journal import StateDir; "
            f"s = StateDir({str(tmp_path)!r}, 'r'); s.open(); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirError, match=f"PID {holder.pid} on"):
            StateDir(tmp_path, "r").open()
    finally:
        holder.communicate("", timeout=30)
    StateDir(tmp_path, "r").open()  # free again once that process is gone


def test_another_runs_journal_and_an_unusable_directory_are_refused(tmp_path) -> None:
    r, _ = _formed()
    journal = r.journal()
    assert journal is not None
    mine = StateDir(tmp_path / "a", "r")
    mine.open()
    mine.write(journal)
    mine.close()
    theirs = StateDir(tmp_path / "a", "other")
    theirs.open()
    with pytest.raises(StateDirError, match="holds run 'r'.s journal, not 'other'.s"):
        theirs.read()
    theirs.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(StateDirError, match="is not usable"):
        StateDir(tmp_path / "file" / "state", "r").open()
    (tmp_path / "a" / "journal.json").write_text("{}")
    with pytest.raises(StateDirError, match="not a coordinator journal"):
        mine.read()


WRITER = """
import sys
from shardwire.coordinator.journal import Journal, StateDir
from tests.coordinator.test_recovery import _formed

base = _formed()[0].journal()
state = StateDir(sys.argv[1], "r")
state.open()
state.write(base.model_copy(update={"generation": 1}))  # one whole journal before any kill
print("writing", flush=True)
for generation in range(2, 1_000_000):  # until killed
    state.write(base.model_copy(update={"generation": generation}))
"""


@pytest.mark.e2e
def test_a_coordinator_killed_mid_journal_write_leaves_a_whole_journal(tmp_path) -> None:
    """A process that writes journals back to back, SIGKILLed at five moments: each time
    the directory holds a whole journal (some generation written), never a torn one, and
    the next coordinator takes the directory and writes over what the kill left."""
    seen = []
    for delay in (0.05, 0.11, 0.23, 0.37, 0.5):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / "state")],
            cwd=os.getcwd(),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
            time.sleep(delay)
        finally:
            writer.kill()
            writer.wait(timeout=30)
        state = StateDir(tmp_path / "state", "r")
        state.open()
        try:
            journal = state.read()
            assert journal is not None and journal.run_id == "r" and len(journal.workers) == 4
            seen.append(journal.generation)
        finally:
            state.close()
    assert all(g >= 1 for g in seen)


def test_the_generation_history_outlives_a_restart() -> None:
    """The journal carries every generation so far with its age; a coordinator started
    again on it shows them, aged by the time since the journal was written."""
    r, journal = _restored(now=100.0)
    (era,) = journal.history
    assert (era.generation, era.world_size, era.duration_s) == (1, 4, None)
    earlier = JournalEra(
        generation=1,
        world_size=4,
        nodes=2,
        started_ago_s=50.0,
        duration_s=40.0,
        ended_by="rank 2 failed: killed",
    )
    current = JournalEra(generation=2, world_size=4, nodes=2, started_ago_s=10.0)
    two = journal.model_copy(update={"generation": 2, "history": [earlier, current]})
    again = Rendezvous(RendezvousConfig(run_id="r", world_size=4, grace=GRACE))
    again.restore(two, 500.0, since_written=5.0)
    info = again.gens.info(500.0)
    assert [(g.generation, g.started_age_s, g.duration_s, g.ended_by) for g in info] == [
        (1, 55.0, 40.0, "rank 2 failed: killed"),
        (2, 15.0, None, ""),
    ]
    assert [e.generation for e in (again.journal() or journal).history] == [1, 2]


def test_a_coordinator_killed_between_generations_finishes_the_restart() -> None:
    """Rank 1 failed and the agents were told to restart; the coordinator dies before
    they are back. Started again on its journal, it tells each agent of the restart
    (again, or for the first time), and their NodeJoins form generation 2."""
    r = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE, max_restarts=2))
    agents = {
        c: NodeJoin(world_size=2, node_id=n, local_world_size=1, max_restarts=2)
        for c, n in ((1, "a"), (2, "b"))
    }
    sent = [a for conn, msg in agents.items() for a in r.node_join(conn, msg, 0.0)]
    ranks = {a.conn: a.msg.node_rank for a in sent if isinstance(a.msg, NodeAssignment)}
    for conn, rank in ranks.items():
        r.join(
            conn + 10,
            join(agents[conn].node_id, 0, world=2, lws=1, rank=rank),
            peer_host="10.0.0.9",
            now=1.0,
        )
    assert r.state is JobState.RUNNING
    failed = next(c for c, rank in ranks.items() if rank == 1) + 10
    r.report_failure(failed, Failure(reason="boom"), now=5.0)
    assert r.state is JobState.RESTARTING and r.generation == 2
    journal = r.journal()
    assert journal is not None and journal.restart is not None and journal.generation == 2
    assert journal.restart.rank == 1 and "boom" in journal.restart.reason
    assert sorted(j.node_id for j in journal.rejoining) == ["a", "b"]
    assert [e.generation for e in journal.history] == [1]
    again = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE, max_restarts=2))
    again.restore(Journal.model_validate_json(journal.model_dump_json()), 50.0)
    assert again.state is JobState.RESTARTING and again.gens.restarts == 1
    assigned: list = []
    for conn, msg in agents.items():
        back = again.node_rejoin(
            conn + 20, NodeRejoin(node_rank=ranks[conn], generation=1, join=msg), 51.0
        )
        assert [type(a.msg) for a in back] == [Rejoined, Restart]  # type: ignore[union-attr]
        assert back[1].msg.generation == 2  # type: ignore[union-attr]
        assigned += again.node_join(conn + 20, msg, 52.0)  # its processes are gone
    got = [a.msg for a in assigned if isinstance(a.msg, NodeAssignment)]  # type: ignore[union-attr]
    assert sorted(m.node_rank for m in got) == [0, 1] and {m.generation for m in got} == {2}
    assert again.journal() is not None and again.journal().forming  # type: ignore[union-attr]
    stranger = NodeRejoin(
        node_rank=0, generation=1, join=NodeJoin(world_size=2, node_id="c", local_world_size=1)
    )
    fresh = Rendezvous(RendezvousConfig(run_id="r", grace=GRACE, max_restarts=2))
    fresh.restore(journal, 60.0)
    assert "is not waited for" in error_of(fresh.node_rejoin(9, stranger, 61.0)).message
