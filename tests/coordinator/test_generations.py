"""Generations in the rendezvous state machine: restarts, the restart budget, fencing of
the ended generation's processes, and elastic membership (``--nnodes MIN:MAX``)."""

from __future__ import annotations

import pytest

from shardwire.coordinator import JobState, Rendezvous, RendezvousConfig, Send
from shardwire.protocol import InvalidArgument
from shardwire.protocol.history import describe, parse_nnodes
from shardwire.protocol.messages import (
    Abort,
    Error,
    Failure,
    Finished,
    Join,
    Leave,
    NodeAssignment,
    NodeJoin,
    Restart,
)
from shardwire.protocol.placement import Placement

LWS = 2


def rdzv(**kw) -> Rendezvous:
    return Rendezvous(RendezvousConfig(run_id="r", **kw))


def node(name: str, *, nodes: int = 2, low: int = 0, budget: int | None = None) -> NodeJoin:
    return NodeJoin(
        world_size=nodes * LWS,
        node_id=name,
        local_world_size=LWS,
        min_nodes=low,
        max_restarts=budget,
    )


def sent(actions, kind: type) -> dict:
    return {a.conn: a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, kind)}


def run_generation(r: Rendezvous, agents: dict[str, int], now: float, first_conn: int) -> dict:
    """Workers of every assigned agent join; returns {conn: Placement}. Agent conn ids are
    the values of ``agents``; worker conns count up from ``first_conn``."""
    out: dict = {}
    conn = first_conn
    world = len(agents) * LWS
    for name in sorted(agents):
        for local in range(LWS):
            msg = Join(world_size=world, node_id=name, local_rank=local, local_world_size=LWS)
            out |= sent(r.join(conn, msg, peer_host="10.0.0.1", now=now), Placement)
            conn += 1
    return out


def started(budget: int = 1, **kw) -> tuple[Rendezvous, dict]:
    r = rdzv(**kw)
    assert r.node_join(100, node("a", budget=budget), 0.0) == []
    assigned = sent(r.node_join(101, node("b", budget=budget), 0.0), NodeAssignment)
    assert {m.generation for m in assigned.values()} == {1}
    rosters = run_generation(r, {"a": 100, "b": 101}, 1.0, 1)
    assert len(rosters) == 4 and r.state is JobState.RUNNING
    return r, rosters


def test_a_failure_with_restarts_left_opens_the_next_generation() -> None:
    r, rosters = started(budget=2)
    actions = r.disconnected(3)  # rank 2's process died
    restarts = sent(actions, Restart)
    assert set(restarts) == {100, 101}
    msg = restarts[100]
    assert msg.generation == 2 and msg.restarts == 1 and msg.max_restarts == 2
    assert "rank 2 failed" in msg.reason
    assert set(sent(actions, Abort)) == {1, 2, 4}  # the survivors of generation 1 stop
    assert r.state is JobState.RESTARTING and r.generation == 2
    # both agents say their processes are gone, but worker connections remain: no start
    assert r.node_join(100, node("a", budget=2), 2.0) == []
    assert r.node_join(101, node("b", budget=2), 2.0) == []
    for conn in (1, 2):
        assert r.disconnected(conn) == []
    assignments = sent(r.disconnected(4), NodeAssignment)
    assert {m.generation for m in assignments.values()} == {2}
    assert {c: m.node_rank for c, m in assignments.items()} == {100: 0, 101: 1}
    history = assignments[100].history
    assert [g.generation for g in history] == [1]
    assert history[0].world_size == 4 and "rank 2 failed" in history[0].ended_by
    again = run_generation(r, {"a": 100, "b": 101}, 3.0, 11)
    assert {m.generation for m in again.values()} == {2}
    # the membership is unchanged, so every node keeps its ranks
    assert sorted(m.rank for m in again.values()) == sorted(m.rank for m in rosters.values())
    status = r.status(4.0)
    assert status.generation == 2 and status.restarts == 1 and status.max_restarts == 2
    assert [g.generation for g in status.generations] == [1, 2]
    assert status.generations[1].duration_s is None


def test_the_job_fails_once_the_budget_is_spent() -> None:
    r, _ = started(budget=1)
    r.disconnected(1)
    for conn in (2, 3, 4):
        r.disconnected(conn)
    r.node_join(100, node("a", budget=1), 2.0)
    r.node_join(101, node("b", budget=1), 2.0)
    run_generation(r, {"a": 100, "b": 101}, 3.0, 11)
    actions = r.report_failure(12, Failure(reason="boom"), 4.0)
    assert r.state is JobState.FAILED and not sent(actions, Restart)
    aborts = sent(actions, Abort)
    assert {100, 101} <= set(aborts) and aborts[100].reason == "boom"
    ended = r.status(5.0).generations
    died = "rank 0 failed: connection to the coordinator closed (process died?)"
    assert [g.ended_by for g in ended] == [died, "rank 1 failed: boom"]


def test_without_restarts_a_failure_ends_the_job_as_before() -> None:
    r, _ = started(budget=0)
    actions = r.disconnected(2)
    assert r.state is JobState.FAILED
    assert not sent(actions, Restart) and {100, 101} <= set(sent(actions, Abort))
    assert r.status(3.0).generations[0].ended_by.startswith("rank 1 failed")


def test_finishing_tells_the_agents() -> None:
    r, _ = started(budget=1)
    for conn in (1, 2, 3):
        assert r.leave(conn, Leave()) == []
    finished = sent(r.leave(4, Leave()), Finished)
    assert set(finished) == {100, 101} and finished[100].generation == 1
    assert r.state is JobState.FINISHED
    assert r.status(9.0).generations[0].ended_by == "finished"


def test_the_coordinators_budget_wins_and_agents_must_agree() -> None:
    r = rdzv(max_restarts=3)
    r.node_join(100, node("a", budget=1), 0.0)
    assert r.gens.max_restarts == 3  # set on the coordinator: agents' values are ignored
    r = rdzv()
    r.node_join(100, node("a", budget=1), 0.0)
    refused = sent(r.node_join(101, node("b", budget=2), 0.0), Error)[101]
    assert refused.code == "bad_request" and "restart budget" in refused.message


def test_an_agent_lost_while_running_restarts_without_its_node_waiting_for_it() -> None:
    r, _ = started(budget=1)
    actions = r.disconnected(101)  # node b's agent is gone
    assert set(sent(actions, Restart)) == {100}
    assert "node 'b' lost" in sent(actions, Restart)[100].reason
    for conn in (1, 2, 3, 4):
        r.disconnected(conn)
    # fixed size: node a alone cannot form generation 2
    assert sent(r.node_join(100, node("a"), 2.0), NodeAssignment) == {}
    assert r.state is JobState.WAITING
    assigned = sent(r.node_join(102, node("b"), 3.0), NodeAssignment)  # b comes back
    assert {m.generation for m in assigned.values()} == {2}


def test_a_restart_that_never_forms_fails_the_job_at_the_join_timeout() -> None:
    r, _ = started(budget=1, join_timeout=10.0)
    r.disconnected(101)
    for conn in (1, 2, 3, 4):
        r.disconnected(conn)
    r.node_join(100, node("a"), 2.0)
    assert r.tick(5.0) == []
    actions = r.tick(13.0)
    assert r.state is JobState.FAILED
    abort = sent(actions, Abort)[100]
    assert "node 'b' lost" in abort.reason and "join timeout" in abort.reason


def test_an_elastic_job_starts_after_the_last_call_and_grows_by_a_generation() -> None:
    r = rdzv(last_call=2.0)
    assert r.node_join(100, node("a", low=1, budget=0), 0.0) == []
    assert r.tick(1.0) == []  # MIN is in; the last call is still open
    assigned = sent(r.tick(2.5), NodeAssignment)
    assert assigned[100].nnodes == 1 and assigned[100].world_size == LWS
    rosters = run_generation(r, {"a": 100}, 3.0, 1)
    assert {m.world_size for m in rosters.values()} == {LWS}
    # a second node arrives: a new generation, which uses no restart
    actions = r.node_join(101, node("b", low=1, budget=0), 4.0)
    assert set(sent(actions, Restart)) == {100} and r.gens.restarts == 0
    assert "membership change" in sent(actions, Restart)[100].reason
    r.disconnected(1)
    r.disconnected(2)
    assigned = sent(r.node_join(100, node("a", low=1, budget=0), 5.0), NodeAssignment)
    assert {m.nnodes for m in assigned.values()} == {2}  # MAX is in: no last call
    grown = run_generation(r, {"a": 100, "b": 101}, 6.0, 11)
    assert {(m.world_size, m.generation) for m in grown.values()} == {(2 * LWS, 2)}


def test_an_elastic_job_goes_on_with_fewer_nodes_when_one_is_lost() -> None:
    r = rdzv(last_call=1.0)
    r.node_join(100, node("a", low=1, budget=1), 0.0)
    r.node_join(101, node("b", low=1, budget=1), 0.0)
    run_generation(r, {"a": 100, "b": 101}, 1.0, 1)
    r.disconnected(101)
    for conn in (1, 2, 3, 4):
        r.disconnected(conn)
    assert sent(r.node_join(100, node("a", low=1, budget=1), 2.0), NodeAssignment) == {}
    assigned = sent(r.tick(3.5), NodeAssignment)
    assert assigned[100].world_size == LWS and assigned[100].generation == 2
    smaller = run_generation(r, {"a": 100}, 4.0, 11)
    assert {m.world_size for m in smaller.values()} == {LWS}


def test_ranks_of_the_ended_generation_cannot_join_the_next() -> None:
    r, _ = started(budget=1)
    r.disconnected(1)
    msg = Join(world_size=4, node_id="a", local_rank=0, local_world_size=LWS)
    refused = sent(r.join(50, msg, peer_host="10.0.0.1", now=2.0), Error)[50]
    assert refused.code == "already_started" and "restarting" in refused.message


def test_node_ranges_parse_and_generations_describe() -> None:
    assert parse_nnodes("3") == (3, 3) and parse_nnodes("1:4") == (1, 4)
    for bad in ("x", "1:"):
        with pytest.raises(InvalidArgument, match=f"must be N or MIN:MAX, got '{bad}'"):
            parse_nnodes(bad)
    for bad in ("0", "3:2"):
        with pytest.raises(InvalidArgument, match=f"--nnodes '{bad}': need 1 <= MIN <= MAX"):
            parse_nnodes(bad)
    r, _ = started(budget=1)
    r.disconnected(1)
    lines = describe(r.status(10.0).generations)
    assert lines[0].startswith("generation 1: 4 ranks on 2 nodes, started 9 s ago, ran 0.0 s")


def test_a_long_history_sends_the_first_and_latest_generations_inside_a_frame() -> None:
    from shardwire.coordinator.generations import Generations
    from shardwire.protocol.control import message_bytes
    from shardwire.protocol.messages import HISTORY_SHOWN, StatusReply

    gens = Generations(max_restarts=500)
    for i in range(200):
        gens.begin(64, 4, float(i))
        gens.end(f"rank {i} failed: " + "a very long traceback line " * 300, float(i) + 0.5)
        gens.advance(failure=True)
    shown = gens.info(300.0)
    assert len(shown) == HISTORY_SHOWN
    assert [g.generation for g in shown] == [1, *range(200 - HISTORY_SHOWN + 2, 201)]
    assert all(len(g.ended_by) <= 1024 for g in shown)
    reply = StatusReply(run_id="r", state="running", generations=shown)
    assert len(message_bytes(reply)) < 64 * 1024


def _rejoin(rank: int, name: str) -> Join:
    """A survivor re-forming in its process: it asks for its rank (as an agent's do)."""
    return Join(
        world_size=2 * LWS,
        node_id=name,
        local_rank=rank % LWS,
        local_world_size=LWS,
        requested_rank=rank,
        reforming=True,
    )


def test_survivors_rejoining_in_their_processes_wait_for_the_next_generation() -> None:
    r, rosters = started(budget=2)
    ranks = {c: p.rank for c, p in rosters.items()}
    actions = r.disconnected(3)  # a rank's process died; the others recover live
    aborts = sent(actions, Abort)
    assert aborts and all(a.restarting for a in aborts.values())  # the job goes on
    survivors = (1, 2, 4)
    node_of = {c: "a" if ranks[c] < LWS else "b" for c in rosters}
    # each survivor leaves generation 1 and joins again on a new connection, at once
    for old in survivors:
        new = old + 20
        assert r.join(new, _rejoin(ranks[old], node_of[old]), peer_host="10.0.0.1", now=2.0) == []
        assert r.disconnected(old) == []
    assert r.state is JobState.RESTARTING  # parked until the agents are ready too
    r.node_join(100, node("a", budget=2), 2.5)
    actions = r.node_join(101, node("b", budget=2), 2.5)
    assert r.state is JobState.WAITING and sent(actions, NodeAssignment)
    # the failed rank's new process joins; the generation forms with every survivor
    replacement = Join(
        world_size=4,
        node_id=node_of[3],
        local_rank=ranks[3] % LWS,
        local_world_size=LWS,
        requested_rank=ranks[3],
    )
    placed = sent(r.join(30, replacement, peer_host="10.0.0.1", now=3.0), Placement)
    assert r.state is JobState.RUNNING and r.generation == 2
    assert {c: p.rank for c, p in placed.items()} == {c + 20: ranks[c] for c in survivors} | {
        30: ranks[3]
    }


@pytest.mark.parametrize("lost", ["a", "b"])
def test_survivors_of_a_lost_node_form_a_smaller_generation_after_the_last_call(lost) -> None:
    """``--nnodes 1:2`` and live recovery: node ``lost``'s agent is gone with its ranks;
    the other node's two ranks re-form in their processes and are the whole of the next
    generation, which starts once the last call ends (ranks 0 and 1, whichever node)."""
    r = rdzv(last_call=1.0)
    r.node_join(100, node("a", low=1, budget=1), 0.0)
    r.node_join(101, node("b", low=1, budget=1), 0.0)
    rosters = run_generation(r, {"a": 100, "b": 101}, 1.0, 1)
    ranks = {c: p.rank for c, p in rosters.items()}
    gone, kept = (101, 100) if lost == "b" else (100, 101)
    actions = r.disconnected(gone)
    assert all(a.restarting for a in sent(actions, Abort).values())
    node_of = {c: "a" if ranks[c] < LWS else "b" for c in rosters}
    survivors = [c for c in rosters if node_of[c] != lost]
    for c in rosters:
        r.disconnected(c) if c not in survivors else None
    for old in survivors:
        assert (
            r.join(old + 20, _rejoin(ranks[old], node_of[old]), peer_host="10.0.0.1", now=2.0) == []
        )
        assert r.disconnected(old) == []
    assert sent(r.node_join(kept, node("ab"[kept - 100], low=1, budget=1), 2.0), Placement) == {}
    assert r.tick(2.5) == []  # the last call is open: the lost node may come back
    actions = r.tick(3.5)
    assert sent(actions, NodeAssignment)[kept].world_size == LWS
    placed = sent(actions, Placement)
    assert r.state is JobState.RUNNING and r.generation == 2
    assert sorted(p.rank for p in placed.values()) == [0, 1]
    assert {(p.world_size, p.node_rank) for p in placed.values()} == {(LWS, 0)}
    assert sent(actions, NodeAssignment)[kept].node_rank == 0
    assert set(placed) == {old + 20 for old in survivors}


def test_survivors_in_a_generation_that_ends_before_it_forms_join_the_next() -> None:
    """Survivors re-forming in their processes have joined generation 2, which waits for
    the failed rank's replacement, when node b's agent is lost: generation 2 ends before
    it formed. The survivors are neither aborted nor fenced off as its processes: their
    joins carry over, and generation 3 forms with node a's (``--nnodes 1:2``)."""
    r = rdzv(last_call=1.0)
    r.node_join(100, node("a", low=1, budget=2), 0.0)
    r.node_join(101, node("b", low=1, budget=2), 0.0)
    rosters = run_generation(r, {"a": 100, "b": 101}, 1.0, 1)
    ranks = {c: p.rank for c, p in rosters.items()}
    node_of = {c: "a" if ranks[c] < LWS else "b" for c in rosters}
    dead = next(c for c in rosters if ranks[c] == 2)
    r.disconnected(dead)
    survivors = [c for c in rosters if c != dead]
    for old in survivors:
        r.join(old + 20, _rejoin(ranks[old], node_of[old]), peer_host="10.0.0.1", now=2.0)
        r.disconnected(old)
    r.node_join(100, node("a", low=1, budget=2), 2.5)
    assert sent(r.node_join(101, node("b", low=1, budget=2), 2.5), NodeAssignment)
    assert r.state is JobState.WAITING  # the survivors are in; the replacement is not
    actions = r.disconnected(101)  # node b's agent is lost
    assert r.state is JobState.RESTARTING and r.generation == 3
    assert not set(sent(actions, Abort)) & {old + 20 for old in survivors}
    r.disconnected(next(c + 20 for c in survivors if node_of[c] == "b"))  # died with b's agent
    assert sent(r.node_join(100, node("a", low=1, budget=2), 3.0), Placement) == {}
    placed = sent(r.tick(4.5), Placement)  # the last call is over
    assert r.state is JobState.RUNNING and r.generation == 3
    assert set(placed) == {c + 20 for c in survivors if node_of[c] == "a"}
    assert sorted(p.rank for p in placed.values()) == [0, 1]


def test_survivors_re_forming_into_a_grown_job_are_admitted_whatever_size_they_knew() -> None:
    """``--nnodes 1:2``: node a ran alone (2 ranks); node b joins. Node a's ranks re-form
    in their processes saying the world size they were started with (2): the job's size
    is the coordinator's to decide, and the grown generation forms with all four."""
    r = rdzv(last_call=1.0)
    r.node_join(100, node("a", low=1, budget=1), 0.0)
    assigned = sent(r.tick(1.5), NodeAssignment)
    assert assigned[100].world_size == LWS
    rosters = run_generation(r, {"a": 100}, 2.0, 1)
    actions = r.node_join(101, node("b", low=1, budget=1), 3.0)  # a node joins: it grows
    assert all(a.restarting for a in sent(actions, Abort).values())
    for old, place in rosters.items():
        rejoin = Join(
            world_size=LWS,
            node_id="a",
            local_rank=place.rank,
            local_world_size=LWS,
            requested_rank=place.rank,
            reforming=True,
        )
        assert r.join(old + 20, rejoin, peer_host="10.0.0.1", now=3.5) == []
        r.disconnected(old)
    r.node_join(100, node("a", low=1, budget=1), 4.0)
    assert r.state is JobState.WAITING and r.job.world == 2 * LWS
    placed = {}
    for local in range(LWS):  # node b's new processes
        msg = Join(world_size=2 * LWS, node_id="b", local_rank=local, local_world_size=LWS)
        placed |= sent(r.join(40 + local, msg, peer_host="10.0.0.2", now=4.5), Placement)
    assert r.state is JobState.RUNNING and r.generation == 2
    assert {c: p.rank for c, p in placed.items() if c >= 20 and c < 40} == {21: 0, 22: 1}
    assert {p.world_size for p in placed.values()} == {2 * LWS}


def test_a_parked_survivor_that_goes_away_is_forgotten_and_one_parked_at_the_end_hears() -> None:
    r, rosters = started(budget=1)
    ranks = {c: p.rank for c, p in rosters.items()}
    r.disconnected(1)
    assert r.join(21, _rejoin(ranks[2], "a"), peer_host="10.0.0.1", now=2.0) == []
    assert r.disconnected(21) == []  # gone before the next generation formed
    assert r.join(22, _rejoin(ranks[4], "b"), peer_host="10.0.0.1", now=2.0) == []
    # the restart never completes (the old processes linger): the job fails, and the
    # parked survivor is told so rather than left waiting
    actions = r.tick(1e6)
    assert r.state is JobState.FAILED
    assert 22 in sent(actions, Abort) and 21 not in sent(actions, Abort)
