"""Heartbeats batched per node: the agent's local socket and the worker's relay, alone
and between a real coordinator, an agent's control client and workers' clients."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

from shardwire.coordinator import JobState
from shardwire.protocol.beats import Heartbeat, NodeBeat
from shardwire.protocol.messages import Join, NodeJoin
from shardwire.worker.runtime.beats import BeatRelay, NodeBeats
from shardwire.worker.runtime.control import ControlClient
from tests.coordinator.rawclient import RawClient
from tests.isolation import RUN_ID
from tests.waiting import until as _until
from tests.worker.cluster import TOKEN, coordinator


def _left_behind(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.exists(p)]


async def test_the_agent_forwards_what_its_workers_beat_in_order_each_interval() -> None:
    sent: list[NodeBeat] = []
    beats = NodeBeats(sent.append, interval=0.1)
    path = await beats.start()
    try:
        folder = Path(path).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # only this user may beat in
        relays = [await BeatRelay.open(path, rank, 1, timeout=10) for rank in (4, 5)]
        for step in range(3):
            for relay in relays:
                assert relay(Heartbeat(step=step))
        await _until(lambda: sum(len(nb.beats) for nb in sent) == 6, "six beats forwarded")
        entries = [e for nb in sent for e in nb.beats]
        assert [(e.rank, e.beat.step) for e in entries if e.rank == 4] == [(4, 0), (4, 1), (4, 2)]
        assert {e.generation for e in entries} == {1}
        before = len(sent)
        await _until(lambda: len(sent) >= before + 2, "keepalives keep coming")
        assert all(not nb.beats for nb in sent[before:])  # nothing new: empty node beats
    finally:
        await beats.aclose()
    assert not folder.exists()  # the socket's directory goes with the agent


async def test_a_relay_whose_agent_is_gone_hands_its_beats_back() -> None:
    beats = NodeBeats(lambda _nb: None, interval=60)
    path = await beats.start()
    relay = await BeatRelay.open(path, 0, 1, timeout=10)
    assert relay(Heartbeat())
    await beats.aclose()
    await _until(lambda: not relay(Heartbeat()), "the relay notices its agent left")
    relay.close()


async def test_a_relay_whose_agent_does_not_read_hands_its_beats_back(tmp_path) -> None:
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deaf.bind(str(tmp_path / "deaf.sock"))
    deaf.listen(1)
    try:
        relay = await BeatRelay.open(str(tmp_path / "deaf.sock"), 0, 1, timeout=10)
        big = Heartbeat(busy_stack="s" * 8000)
        taken = 0
        for _ in range(20_000):  # bounded: ~160 MB would be far past the 1 MiB backlog
            if not relay(big):
                break
            taken += 1
            await asyncio.sleep(0)
        assert 0 < taken < 20_000  # took beats until its agent's backlog passed the limit
        relay.close()
    finally:
        deaf.close()


async def test_garbage_on_the_socket_closes_that_connection_only() -> None:
    sent: list[NodeBeat] = []
    beats = NodeBeats(sent.append, interval=0.05)
    path = await beats.start()
    try:
        good = await BeatRelay.open(path, 1, 1, timeout=10)
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"\x00" * 64)  # not a frame
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed by the agent
        writer.close()
        assert good(Heartbeat(step=9))
        await _until(lambda: any(e.beat.step == 9 for nb in sent for e in nb.beats), "served")
    finally:
        await beats.aclose()


async def test_a_job_beats_through_its_agents_and_quiet_workers_are_not_closed() -> None:
    """Two nodes of two workers: each agent forwards its workers' beats; the workers'
    own connections stay quiet past the idle limit and stay open; a quiet status client
    is still closed at that limit."""
    async with coordinator(4, heartbeat_timeout=5.0, idle_timeout=1.0) as server:
        host, port = server.address
        agents, workers, nodes, assigned = [], [], [], []
        try:
            for name in ("a", "b"):
                agent = ControlClient(token=TOKEN, run_id=RUN_ID, role="agent")
                await agent.connect(host, port, timeout=10)
                nodes.append(NodeBeats(agent.send, interval=0.2))
                agents.append((agent, await nodes[-1].start()))
                join = NodeJoin(world_size=4, node_id=name, local_world_size=2)
                assigned.append(asyncio.create_task(agent.node_join(join, timeout=20)))
            assert [a.node_rank for a in await asyncio.gather(*assigned)] == [0, 1]
            joins = []
            for rank in range(4):  # as a worker under an agent: beats relayed from the start
                client = ControlClient(token=TOKEN, run_id=RUN_ID, role="worker")
                await client.connect(host, port, timeout=10)
                path = agents[rank // 2][1]
                client.relay(await BeatRelay.open(path, rank, 1, timeout=10))
                client.start_heartbeats(0.2)
                workers.append(client)
                msg = Join(
                    world_size=4,
                    node_id="ab"[rank // 2],
                    local_rank=rank % 2,
                    local_world_size=2,
                    requested_rank=rank,
                )
                joins.append(client.join(msg, timeout=20))
            placed = await asyncio.gather(*joins)
            assert sorted(p.rank for p in placed) == [0, 1, 2, 3]
            for client, place in zip(workers, placed, strict=True):
                client.set_progress(Heartbeat(step=10 + place.rank))
            rdzv = server.rendezvous
            await _until(lambda: rdzv.beats_via["agent"] >= 20, "beats arrive through agents")
            status = await RawClient.open(server.address)
            await status.authenticate(TOKEN, role="client")
            assert await status.closed_by_server(timeout=20)  # quiet 1 s: closed
            await asyncio.sleep(1.5)  # past the idle limit for the workers too
            assert rdzv.state is JobState.RUNNING
            assert all(w.connected for w in rdzv.workers)
            steps = {row.rank: row.step for row in rdzv.status(0.0).ranks}
            assert steps == {0: 10, 1: 11, 2: 12, 3: 13}
            assert rdzv.beats_via["worker"] == 0  # every beat went through an agent
            for client, place in zip(workers, placed, strict=True):
                client.set_progress(Heartbeat(step=20 + place.rank))  # relayed, then
                client.leave()  # its latest progress goes ahead of its leave, directly
            await _until(lambda: rdzv.state is JobState.FINISHED, "every rank left")
            steps = {row.rank: row.step for row in rdzv.status(0.0).ranks}
            assert steps == {0: 20, 1: 21, 2: 22, 3: 23}
            assert rdzv.beats_via["worker"] == 4
        finally:
            for client in workers:
                client.leave()
                await client.aclose()
            for (agent, _path), node in zip(agents, nodes, strict=False):
                await node.aclose()
                await agent.aclose()
    assert not _left_behind([p for _a, p in agents])
