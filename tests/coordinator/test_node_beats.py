"""Heartbeats batched by node agents: packing, and the coordinator applying them (pure)."""

from __future__ import annotations

from shardwire.coordinator import JobState, Rendezvous, RendezvousConfig
from shardwire.protocol import FrameDecoder, Limits
from shardwire.protocol.beats import NODE_BEATS, Heartbeat, NodeBeat, RankBeat, pack_beats
from shardwire.protocol.control import frame_message, message_bytes
from shardwire.protocol.frames import MAX_META_BYTES
from shardwire.protocol.linkreports import LinkReport
from shardwire.protocol.messages import Abort, Join, NodeJoin

from .test_rendezvous import start


def _entry(rank: int, generation: int = 1, **beat) -> RankBeat:
    return RankBeat(rank=rank, generation=generation, beat=Heartbeat(**beat))


def _worst(rank: int) -> RankBeat:
    """The largest heartbeat a worker sends: a stall's stack, 512 timings, 64 links."""
    big = 1 << 40
    links = [LinkReport(peer=p, path="tcp", bytes_sent=big, timed_us=big) for p in range(64)]
    return _entry(
        rank,
        step=1 << 40,
        busy_s=99.0,
        busy_at="x" * 256,
        busy_stack="y" * 9000,
        timings=[(1 << 30, 1 << 19, 1 << 40, 1 << 40)] * 512,
        links=links,
    )


def test_beats_pack_in_order_into_the_fewest_frames_that_fit() -> None:
    beats = [_worst(r) for r in range(7)] + [_entry(r, step=r) for r in range(7, 40)]
    packed = pack_beats(beats)
    assert [e for nb in packed for e in nb.beats] == beats  # nothing lost, nothing reordered
    # a worst case is about 32 KB: one a frame, the small ones beside the last
    assert [len(nb.beats) for nb in packed] == [1] * 6 + [34]
    for nb in packed:
        frame = message_bytes(nb)
        assert len(frame) < MAX_META_BYTES  # every message fits a control frame
    many = [_entry(r) for r in range(NODE_BEATS + 1)]
    assert [len(nb.beats) for nb in pack_beats(many, budget=1 << 30)] == [NODE_BEATS, 1]
    assert sum(len(nb.beats) for nb in pack_beats(many)) == NODE_BEATS + 1
    assert pack_beats([]) == [NodeBeat()]  # an agent's keepalive


def test_a_node_beat_survives_its_wire_form() -> None:
    (nb,) = pack_beats([_entry(3, step=7, loss=0.5)])
    (frame,) = FrameDecoder(limits=Limits(max_payload=0)).feed(message_bytes(nb))
    assert frame_message(frame) == nb


def _agents_job() -> Rendezvous:
    """Two nodes of two ranks under agents (conns 100, 101), workers 0..3 running."""
    r = Rendezvous(RendezvousConfig(run_id="r", world_size=4, heartbeat_timeout=5))
    for conn, name in ((100, "a"), (101, "b")):
        r.node_join(conn, NodeJoin(world_size=4, node_id=name, local_world_size=2), 0.0)
    joins = {
        c: Join(world_size=4, node_id=n, local_rank=lr, local_world_size=2, requested_rank=c)
        for c, (n, lr) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    }
    start(r, joins)
    assert r.state is JobState.RUNNING
    return r


def test_an_agent_beats_for_its_own_node_and_the_running_generation_only() -> None:
    r = _agents_job()
    batch = NodeBeat(
        beats=[
            _entry(0, step=5, loss=1.5),
            _entry(1, step=6),
            _entry(2, step=99),  # node b's rank: agent a does not speak for it
            _entry(1, generation=2, step=77),  # not this generation
        ]
    )
    assert r.node_beat(100, batch, now=4.0) == []
    rows = {row.rank: row for row in r.status(4.0).ranks}
    assert (rows[0].step, rows[1].step, rows[2].step) == (5, 6, 0)
    assert r.beats_via == {"worker": 0, "agent": 2}
    assert list(r.curves.losses) == [(5, 1.5)]  # rank 0's loss curve, as from its own beat
    assert r.node_beat(7, NodeBeat(beats=[_entry(3)]), now=4.0) == []  # not an agent
    assert r.beats_via["agent"] == 2


def test_ranks_beaten_for_stay_alive_and_a_silent_one_is_still_named() -> None:
    r = _agents_job()
    for t in (2.0, 4.0, 6.0, 8.0):
        r.node_beat(100, NodeBeat(beats=[_entry(0), _entry(1)]), now=t)
        r.node_beat(101, NodeBeat(beats=[_entry(2)]), now=t)  # rank 3 stopped beating
        if t < 5.0:
            assert r.tick(t) == []
    actions = r.tick(8.0)
    aborts = [a.msg for a in actions if isinstance(a.msg, Abort)]
    assert aborts and all(m.rank == 3 and "no heartbeat" in m.reason for m in aborts)
    assert r.state is JobState.FAILED


def test_a_running_worker_is_beating_whatever_way_its_beats_come() -> None:
    r = _agents_job()
    assert all(r.beating(c) for c in range(4))
    assert not r.beating(100)  # an agent: its own connection must stay active
    r.disconnected(3)
    assert not r.beating(3)


def test_while_the_job_forms_an_agent_beats_for_the_ranks_its_workers_asked_for() -> None:
    r = Rendezvous(RendezvousConfig(run_id="r", world_size=4, heartbeat_timeout=5))
    for conn, name in ((100, "a"), (101, "b")):
        r.node_join(conn, NodeJoin(world_size=4, node_id=name, local_world_size=2), 0.0)
    r.join(
        0,
        Join(world_size=4, node_id="a", local_rank=0, local_world_size=2, requested_rank=0),
        peer_host="h",
        now=0.0,
    )
    r.join(
        1,
        Join(world_size=4, node_id="a", local_rank=1, local_world_size=2, requested_rank=1),
        peer_host="h",
        now=0.0,
    )
    assert r.state is JobState.WAITING
    assert r.beating(0) and r.beating(1)  # quiet, but bounded by the join deadline
    r.node_beat(100, NodeBeat(beats=[_entry(0, busy_s=12.0, busy_at="x.py:1"), _entry(3)]), 1.0)
    assert r.beats_via["agent"] == 1  # rank 3 has not joined: dropped
    (row,) = [w for w in r.workers if w.conn == 0]
    assert row.last_seen == 1.0 and row.progress.busy_s == 12.0
    r.disconnected(1)  # left while forming: its rank is free again, and so are its beats
    r.node_beat(100, NodeBeat(beats=[_entry(1)]), 2.0)
    assert r.beats_via["agent"] == 1
