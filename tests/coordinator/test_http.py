"""The coordinator's HTTP views of a live job: health, readiness, status, metrics, page."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import numpy as np
import pytest

from shardwire.coordinator.__main__ import http_port_chosen, settings_from
from shardwire.coordinator.http import StatusHTTP
from shardwire.coordinator.server import CoordinatorServer
from shardwire.protocol import InvalidArgument
from shardwire.worker import init
from tests.coordinator.rawclient import RawClient
from tests.worker.cluster import TOKEN, coordinator, status_http, worker_config


async def test_views_of_a_running_job() -> None:
    async with coordinator(2) as server, status_http(server) as base:
        done = asyncio.Event()
        reported = [asyncio.Event(), asyncio.Event()]

        async def worker(i: int):
            async with init(worker_config(server, 2, i)) as pg:
                await pg.all_reduce(np.ones(1000))
                for step in (10, 20):
                    pg.report_progress(step, 50.0 * (pg.rank + 1), loss=1.0 / step)
                reported[pg.rank].set()
                await done.wait()

        workers = asyncio.gather(worker(0), worker(1))
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in reported)), 10)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as web:
                for _ in range(100):  # heartbeats travel on other connections: poll, bounded
                    async with web.get(f"{base}/api/status") as response:
                        status = await response.json()
                    if [r["step"] for r in status["ranks"]] == [20, 20]:
                        break
                    await asyncio.sleep(0.02)
                async with web.get(f"{base}/api/status?offset=1&limit=1") as response:
                    paged = await response.json()
                async with web.get(f"{base}/api/status?limit=all") as response:
                    assert response.status == 400
                async with web.get(f"{base}/healthz") as response:
                    assert response.status == 200
                async with web.get(f"{base}/readyz") as response:
                    assert response.status == 200 and (await response.text()) == "running\n"
                async with web.get(f"{base}/metrics") as response:
                    metrics = await response.text()
                async with web.get(f"{base}/") as response:
                    page = await response.text()
        finally:
            done.set()
            await workers
    assert status["state"] == "running" and status["world_size"] == 2
    assert [r["rank"] for r in paged["ranks"]] == [1] and paged["total"] == 2
    assert [(r["rank"], r["step"], r["samples_per_s"]) for r in status["ranks"]] == [
        (0, 20, 50.0),
        (1, 20, 100.0),
    ]
    assert all(r["bytes_sent"] >= 8000 for r in status["ranks"])  # the all_reduce
    assert status["losses"][-1] == {"step": 20, "loss": 0.05}
    texts = [e["text"] for e in status["events"]]
    assert any("job running" in t for t in texts)
    assert 'shardwire_rank_step{rank="1"} 20.0' in metrics
    assert 'shardwire_job_state{state="running"} 1.0' in metrics
    assert "shardwire_rank_sent_bytes_total" in metrics
    assert "<title>shardwire status</title>" in page and "/api/status" in page


async def test_readiness_fails_after_the_job_failed() -> None:
    async with coordinator(1) as server, status_http(server) as base:
        with pytest.raises(ValueError, match="boom"):
            async with init(worker_config(server, 1, 0)):
                raise ValueError("boom")  # the session reports it as this rank's failure
        await asyncio.wait_for(server.done.wait(), 60)
        async with aiohttp.ClientSession() as web:
            async with web.get(f"{base}/readyz") as response:
                assert response.status == 503
            async with web.get(f"{base}/api/status") as response:
                status = await response.json()
    assert status["state"] == "failed"
    assert status["failure"] == "rank 0: raised ValueError: boom"


async def test_slow_and_excess_http_connections_are_dropped() -> None:
    async with coordinator(2) as server:
        http = StatusHTTP(server.rendezvous, request_timeout=3.0, max_connections=3)
        host, port = await http.start("127.0.0.1", 0)
        clients: list[RawClient] = []
        try:
            slow = await RawClient.open((host, port))
            slow.writer.write(b"GET /api/st")  # a request that never completes
            idle = [await RawClient.open((host, port)) for _ in range(2)]
            extra = await RawClient.open((host, port))  # the fourth: over the limit
            clients = [slow, *idle, extra]
            assert await extra.closed_by_server(timeout=2)  # on arrival, not at 3 s
            for client in (slow, *idle):  # at the request deadline
                assert await client.closed_by_server(timeout=15)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as web:
                async with web.get(f"http://{host}:{port}/healthz") as response:
                    assert response.status == 200  # slots are free again
        finally:
            for client in clients:
                client.close()
            await http.aclose()


def test_api_status_pages_and_metrics_keep_a_bounded_number_of_series() -> None:
    from shardwire.coordinator import Rendezvous, RendezvousConfig
    from shardwire.coordinator.http import API_PAGE, METRICS_RANKS, MetricsCollector, status_json
    from shardwire.protocol.messages import Heartbeat, Join

    world, lws = 2500, 50
    r = Rendezvous(RendezvousConfig(run_id="big", world_size=world))
    for i in range(world):
        node = f"n{i // lws:03d}"
        join = Join(world_size=world, node_id=node, local_rank=i % lws, local_world_size=lws)
        r.join(i, join, peer_host="10.0.0.1", now=0.0)
    first = status_json(r, 1.0, 100.0)
    assert first["total"] == world and len(first["ranks"]) == API_PAGE
    last = status_json(r, 1.0, 100.0, offset=2000, limit=10_000)  # the limit is capped
    assert [row["rank"] for row in last["ranks"]] == list(range(2000, 2500))
    for conn in range(world):  # steps 5.., except two ranks past the first 1,024
        steps = {1500: 2, 2400: 9000}
        r.heartbeat(conn, Heartbeat(step=steps.get(conn, 5 + conn % 7)), now=1.0)
    r.disconnected(2499)  # failed: one rank in another state
    families = {f.name: f for f in MetricsCollector(r, lambda: 1.0).collect()}
    assert len(families["shardwire_rank_step"].samples) == METRICS_RANKS
    by_state = {s.labels["state"]: s.value for s in families["shardwire_ranks"].samples}
    assert by_state == {"running": world - 1, "failed": 1}  # every rank counted
    assert families["shardwire_step_min"].samples[0].value == 2
    assert families["shardwire_step_max"].samples[0].value == 9000


async def test_a_taken_port_is_refused_typed_unless_it_is_the_default_s(caplog) -> None:
    """Two coordinators on a host: the second's status page gives way to a free port when
    nobody chose its port (29480 by default), and is refused, saying which flag, when it
    was chosen; a taken coordinator port is refused the same way."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        async with coordinator(1) as server:
            http = StatusHTTP(server.rendezvous)
            try:
                with pytest.raises(InvalidArgument, match=rf"127\.0\.0\.1:{taken}: .*--http-port"):
                    await http.start("127.0.0.1", taken)
                with caplog.at_level(logging.WARNING, logger="shardwire.coordinator.http"):
                    host, port = await http.start("127.0.0.1", taken, free_if_taken=True)
                assert port != taken and f"port {taken} on 127.0.0.1 is taken" in caplog.text
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as web:
                    async with web.get(f"http://{host}:{port}/healthz") as response:
                        assert response.status == 200
            finally:
                await http.aclose()
            other = CoordinatorServer(server._config, TOKEN)
            with pytest.raises(InvalidArgument, match=rf"127\.0\.0\.1:{taken}: .*--port"):
                await other.start("127.0.0.1", taken)


def test_the_status_page_s_port_counts_as_chosen_from_a_flag_or_the_environment(
    monkeypatch,
) -> None:
    monkeypatch.delenv("SHARDWIRE_HTTP_PORT", raising=False)
    assert not http_port_chosen(settings_from([]))
    assert http_port_chosen(settings_from(["--http-port", "29480"]))
    monkeypatch.setenv("SHARDWIRE_HTTP_PORT", "29480")
    assert http_port_chosen(settings_from([]))
