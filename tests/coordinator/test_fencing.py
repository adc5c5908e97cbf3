"""A restart over real connections: the ended generation's processes are refused at the
handshake, the next generation forms once they are gone, and the HTTP views show every
generation, the generation gauge and the restart counter."""

from __future__ import annotations

import aiohttp
import pytest

from shardwire.protocol import RendezvousError
from shardwire.protocol.messages import Abort, Failure, Join, NodeAssignment, NodeJoin, Restart
from shardwire.protocol.placement import Placement
from tests.coordinator.rawclient import RawClient
from tests.worker.cluster import TOKEN, coordinator, status_http

NODE = NodeJoin(world_size=1, node_id="a", local_world_size=1)
JOIN = Join(world_size=1, node_id="a", local_rank=0, local_world_size=1, listen_port=1)


async def _connect(server, *, role: str, generation: int = 0) -> RawClient:
    client = await RawClient.open(server.address)
    await client.authenticate(TOKEN, role=role, generation=generation)
    return client


async def test_a_process_of_an_ended_generation_is_refused_and_cannot_disturb_the_next() -> None:
    async with coordinator(max_restarts=1) as server, status_http(server) as base:
        agent = await _connect(server, role="agent")
        agent.send(NODE)
        assert isinstance(first := await agent.recv(), NodeAssignment) and first.generation == 1
        worker = await _connect(server, role="worker", generation=1)
        worker.send(JOIN)
        assert isinstance(roster := await worker.recv(), Placement) and roster.generation == 1
        worker.send(Failure(reason="raised ValueError: boom"))
        restart = await agent.recv()
        assert isinstance(restart, Restart) and restart.generation == 2
        assert restart.restarts == 1 and "boom" in restart.reason
        # a process of generation 1 that dials again is refused at the handshake
        stale = await RawClient.open(server.address)
        with pytest.raises(RendezvousError) as refused:
            await stale.authenticate(TOKEN, role="worker", generation=1)
        assert refused.value.code == "stale_generation"
        assert "generation 1 is over" in str(refused.value)
        stale.close()
        # the agent says its processes are gone, but the old connection is still open
        agent.send(NODE)
        worker.send(JOIN)  # the old process tries to join again on its own connection
        assert isinstance(await worker.recv(), Abort)
        worker.close()
        second = await agent.recv(timeout=10)
        assert isinstance(second, NodeAssignment) and second.generation == 2
        assert [g.generation for g in second.history] == [1]
        fresh = await _connect(server, role="worker", generation=2)
        fresh.send(JOIN)
        assert isinstance(roster := await fresh.recv(), Placement) and roster.generation == 2
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as web:
            async with web.get(f"{base}/api/status") as response:
                status = await response.json()
            async with web.get(f"{base}/metrics") as response:
                metrics = await response.text()
            async with web.get(f"{base}/") as response:
                page = await response.text()
        for client in (fresh, agent):
            client.close()
    assert status["generation"] == 2 and status["restarts"] == 1
    assert status["max_restarts"] == 1 and status["failure"] == ""
    gens = status["generations"]
    assert [g["generation"] for g in gens] == [1, 2]
    assert "boom" in gens[0]["ended_by"] and gens[1]["duration_s"] is None
    assert all(g["started_at"] > 1e9 for g in gens)  # wall-clock seconds
    assert "shardwire_generation 2.0" in metrics
    assert "shardwire_restarts_total 1.0" in metrics
    assert 'id="generations"' in page and "ended_by" in page
