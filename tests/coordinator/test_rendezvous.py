"""The rendezvous state machine, driven without sockets or clocks."""

from __future__ import annotations

import pytest

from shardwire.coordinator import Close, JobState, Rendezvous, RendezvousConfig, Send
from shardwire.protocol.messages import (
    Abort,
    Error,
    Failure,
    Heartbeat,
    Join,
    Leave,
    NodeAssignment,
    NodeJoin,
)
from shardwire.protocol.placement import PeerPage, PeerQuery, Placement


def rdzv(world: int | None = 4, **kw) -> Rendezvous:
    return Rendezvous(RendezvousConfig(run_id="r", world_size=world, **kw))


def join(node: str = "a", local: int = 0, *, world: int = 4, lws: int = 2, rank=None) -> Join:
    return Join(
        world_size=world,
        node_id=node,
        local_rank=local,
        local_world_size=lws,
        listen_port=1000 + local,
        requested_rank=rank,
    )


def rosters(actions) -> dict:
    return {a.conn: a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, Placement)}


def error_of(actions) -> Error:
    sends = [a.msg for a in actions if isinstance(a, Send)]
    assert isinstance(sends[0], Error) and isinstance(actions[-1], Close)
    return sends[0]


def start(r: Rendezvous, joins: dict) -> dict:
    out = {}
    for conn, msg in joins.items():
        out |= rosters(r.join(conn, msg, peer_host="10.0.0.9", now=0.0))
    return out


@pytest.mark.parametrize(
    ("hosts", "one_machine"),
    [
        (["127.0.0.1", "127.0.0.2"], True),
        (["127.0.0.1", "10.0.0.9"], False),
        (["::1", "::1"], True),
        (["node-a", "node-a"], False),
    ],
)
def test_placements_say_whether_every_worker_is_on_one_machine(hosts, one_machine) -> None:
    r = rdzv(world=2)
    got: dict = {}
    for conn, host in enumerate(hosts):
        got |= rosters(r.join(conn, join(str(conn), world=2, lws=1), peer_host=host, now=0.0))
    assert [m.one_machine for m in got.values()] == [one_machine] * 2


def test_ranks_are_contiguous_per_node_in_node_id_order() -> None:
    r = rdzv()
    got = start(r, {1: join("b", 1), 2: join("a", 0), 3: join("b", 0), 4: join("a", 1)})
    assert {c: m.rank for c, m in got.items()} == {2: 0, 4: 1, 3: 2, 1: 3}
    place = got[1]
    assert place.generation == 1 and place.world_size == 4
    assert (place.local_rank, place.local_world_size, place.node_rank) == (1, 2, 1)
    (page,) = [a.msg for a in r.peer_page(1, PeerQuery(ranks=[3, 1, 2]))]
    assert isinstance(page, PeerPage) and page.generation == 1
    assert [(m.rank, m.node_id, m.node_rank, m.local_rank) for m in page.members] == [
        (3, "b", 1, 1),
        (1, "a", 0, 1),
        (2, "b", 1, 0),
    ]
    assert all(m.host == "10.0.0.9" for m in page.members)
    assert r.state is JobState.RUNNING


def test_members_are_asked_by_workers_of_the_formed_job_only() -> None:
    r = rdzv()
    r.join(1, join("a", 0), peer_host="h", now=0)
    assert error_of(r.peer_page(1, PeerQuery(ranks=[0]))).code == "bad_request"  # not formed
    assert error_of(r.peer_page(9, PeerQuery(ranks=[0]))).code == "bad_request"  # not a worker


def test_requested_ranks_fix_their_node() -> None:
    r = rdzv()
    got = start(
        r, {1: join("a", 0, rank=2), 2: join("a", 1, rank=3), 3: join("z", 0), 4: join("z", 1)}
    )
    assert {c: m.rank for c, m in got.items()} == {1: 2, 2: 3, 3: 0, 4: 1}


def test_world_size_from_first_joiner_when_unconfigured() -> None:
    r = rdzv(None)
    assert r.join(1, join(world=2, lws=1), peer_host="h", now=0) == []
    assert error_of(r.join(2, join("b", world=3, lws=1), peer_host="h", now=0)).code == "world_size"


@pytest.mark.parametrize(
    ("first", "second", "code", "text"),
    [
        (join("a", 0), join("a", 0), "duplicate_rank", "already has local rank 0"),
        (
            join("a", 0, rank=0),
            join("b", 0, rank=0),
            "duplicate_rank",
            "rank 0 was already requested",
        ),
        (join("a", 0), join("a", 1, world=6), "world_size", "world size disagreement"),
        (join("a", 0), join("b", 0, lws=4), "world_size", "processes-per-node disagreement"),
        (join("a", 0), join("b", 5, lws=2), "bad_request", "local rank 5"),
        (join("a", 0), join("b", 1, rank=2), "bad_request", "requested rank 2 does not fit"),
        (join("a", 0, rank=0), join("a", 1, rank=3), "bad_request", "ranks on two nodes"),
        (join("a", 0, rank=0), join("b", 1, rank=1), "duplicate_rank", "node rank 0 is taken"),
    ],
)
def test_membership_errors(first: Join, second: Join, code: str, text: str) -> None:
    r = rdzv()
    assert r.join(1, first, peer_host="h", now=0) == []
    err = error_of(r.join(2, second, peer_host="h", now=0))
    assert err.code == code and text in err.message


def test_too_many_nodes_is_refused() -> None:
    r = rdzv()
    r.join(1, join("a", 0), peer_host="h", now=0)
    r.join(2, join("b", 0), peer_host="h", now=0)
    assert error_of(r.join(3, join("c", 0), peer_host="h", now=0)).code == "world_size"


def test_join_after_start_is_refused() -> None:
    r = rdzv(2)
    start(r, {1: join("a", 0, world=2, lws=1), 2: join("b", 0, world=2, lws=1)})
    err = error_of(r.join(3, join("c", 0, world=2, lws=1), peer_host="h", now=0))
    assert err.code == "already_started" and "running" in err.message


def test_join_timeout_lists_missing_requested_ranks() -> None:
    r = rdzv(4, join_timeout=10)
    r.join(1, join("a", 0, rank=0), peer_host="h", now=0)
    r.join(2, join("a", 1, rank=1), peer_host="h", now=1)
    assert r.tick(9.0) == []
    actions = r.tick(10.5)
    errors = [a.msg for a in actions if isinstance(a, Send)]
    assert len(errors) == 2
    assert errors[0].code == "join_timeout"
    assert "2 of 4 workers joined; missing ranks 2-3" in errors[0].message
    assert r.state is JobState.WAITING  # the next attempt starts clean


def test_join_timeout_counts_per_node_without_requested_ranks() -> None:
    r = rdzv(4, join_timeout=1)
    r.join(1, join("a", 0), peer_host="h", now=0)
    err = [a.msg for a in r.tick(2) if isinstance(a, Send)][0]
    assert "1 of 4 workers joined (nodes: a 1/2)" in err.message


def test_disconnect_while_waiting_frees_the_slot() -> None:
    r = rdzv(2)
    r.join(1, join("a", 0, world=2, lws=1), peer_host="h", now=0)
    assert r.disconnected(1) == []
    r.join(2, join("a", 0, world=2, lws=1), peer_host="h", now=0)  # same slot, no error
    assert rosters(r.join(3, join("b", 0, world=2, lws=1), peer_host="h", now=0))


def test_disconnect_while_waiting_frees_a_requested_rank_and_its_node_rank() -> None:
    r = rdzv(4)
    r.join(1, join("a", 0, rank=0), peer_host="h", now=0)
    assert r.disconnected(1) == []
    assert r.join(2, join("b", 0, rank=0), peer_host="h", now=0) == []  # rank 0 is free again
    err = error_of(r.join(3, join("a", 1, rank=1), peer_host="h", now=0))
    assert err.code == "duplicate_rank" and "node rank 0 is taken by 'b'" in err.message


def _running(world: int = 3) -> Rendezvous:
    r = rdzv(world, heartbeat_timeout=5)
    start(r, {c: join(f"n{c}", 0, world=world, lws=1) for c in range(world)})
    return r


def test_missed_heartbeats_abort_naming_the_rank() -> None:
    r = _running()
    for conn in (0, 2):
        r.heartbeat(conn, Heartbeat(step=3), now=4.0)
    assert r.tick(4.5) == []
    actions = r.tick(5.5)
    aborts = {a.conn: a.msg for a in actions}
    # the silent rank hears it too: a process that was only frozen learns it is out
    assert set(aborts) == {0, 1, 2}
    assert all(
        isinstance(m, Abort) and m.rank == 1 and "no heartbeat" in m.reason for m in aborts.values()
    )
    assert r.state is JobState.FAILED and r.failure.rank == 1


def test_the_oldest_heartbeat_fails_first_and_equals_name_the_lowest_rank() -> None:
    r = _running(500)
    rank_of = {w.conn: w.rank for w in r.workers}
    for conn in range(500):
        if conn not in (7, 300, 301):
            r.heartbeat(conn, Heartbeat(step=1), now=3.0)
    r.heartbeat(7, Heartbeat(step=1), now=1.0)  # then silent, but beat later than 300, 301
    assert r.tick(4.9) == []
    actions = r.tick(5.5)  # 300 and 301 silent since the start, 7 for 4.5 s only
    assert actions and actions[0].msg.rank == min(rank_of[300], rank_of[301])


def test_closed_connection_aborts_the_job() -> None:
    r = _running()
    actions = r.disconnected(2)
    assert {a.conn for a in actions} == {0, 1}
    assert all(a.msg.rank == 2 and "closed" in a.msg.reason for a in actions)


def test_reported_failure_carries_the_traceback_and_later_failures_are_ignored() -> None:
    r = _running()
    actions = r.report_failure(
        1, Failure(reason="raised KeyError: 'x'", traceback="Traceback..."), now=1.0
    )
    assert {a.conn for a in actions} == {0, 1, 2}  # the reporter hears the verdict too
    assert actions[0].msg == Abort(rank=1, reason="raised KeyError: 'x'", traceback="Traceback...")
    assert r.report_failure(0, Failure(reason="PeerFailed"), now=1.0) == []
    assert r.disconnected(2) == []
    assert r.failure.rank == 1


def test_everyone_leaving_finishes_the_job() -> None:
    r = _running()
    for conn in range(3):
        r.leave(conn, Leave())
    assert r.state is JobState.FINISHED
    assert r.disconnected(0) == []  # closing after leave is not a failure


def test_node_agents_get_node_ranks_in_node_id_order() -> None:
    r = rdzv(4)
    assert r.node_join(1, NodeJoin(world_size=4, node_id="zeta", local_world_size=2), 0) == []
    actions = r.node_join(2, NodeJoin(world_size=4, node_id="alpha", local_world_size=2), 0)
    got = {a.conn: a.msg for a in actions}
    assert got == {
        2: NodeAssignment(node_rank=0, nnodes=2, world_size=4),
        1: NodeAssignment(node_rank=1, nnodes=2, world_size=4),
    }


def test_the_schedulers_node_index_orders_node_ranks_before_names() -> None:
    r = rdzv(6)

    def agent(name: str, index: int | None) -> NodeJoin:
        return NodeJoin(world_size=6, node_id=name, local_world_size=2, node_index=index)

    assert r.node_join(1, agent("alpha", 7), 0) == []
    assert r.node_join(2, agent("beta", None), 0) == []
    actions = r.node_join(3, agent("zeta", 2), 0)
    assert {a.conn: a.msg.node_rank for a in actions} == {3: 0, 1: 1, 2: 2}


def test_a_node_index_taken_by_another_node_is_refused() -> None:
    r = rdzv(4)
    r.node_join(1, NodeJoin(world_size=4, node_id="a", local_world_size=2, node_index=0), 0)
    clash = NodeJoin(world_size=4, node_id="b", local_world_size=2, node_index=0)
    err = error_of(r.node_join(2, clash, 0))
    assert err.code == "duplicate_rank"
    assert "node index 0 is already node 'a'" in err.message and "'b'" in err.message


def test_duplicate_node_agent_is_refused() -> None:
    r = rdzv(4)
    r.node_join(1, NodeJoin(world_size=4, node_id="a", local_world_size=2), 0)
    err = error_of(r.node_join(2, NodeJoin(world_size=4, node_id="a", local_world_size=2), 0))
    assert err.code == "duplicate_rank"


def test_agent_receives_the_abort() -> None:
    r = rdzv(1)
    r.node_join(9, NodeJoin(world_size=1, node_id="a", local_world_size=1), 0)
    start(r, {1: join("a", 0, world=1, lws=1)})
    assert {a.conn for a in r.disconnected(1)} == {9}


def test_failure_reported_by_a_peer_blames_the_dead_rank() -> None:
    r = _running()
    actions = r.report_failure(0, Failure(rank=2, reason="connection lost"), now=1.0)
    assert {a.conn for a in actions} == {0, 1, 2}  # rank 2 may still hear it
    assert r.failure.rank == 2 and "reported by rank 0" in r.failure.reason
    assert r.disconnected(0) == []  # the reporter closing afterwards changes nothing
    assert r.failure.rank == 2
