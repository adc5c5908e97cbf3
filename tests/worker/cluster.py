"""An in-process coordinator plus N workers over loopback TCP, for integration tests."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any

from shardwire.coordinator import CoordinatorServer, RendezvousConfig, ServerConfig
from shardwire.coordinator.http import StatusHTTP
from shardwire.protocol import Token
from shardwire.worker import WorkerConfig
from tests.isolation import RUN_ID

TOKEN = Token("cluster-token")


@contextlib.asynccontextmanager
async def coordinator(
    world_size: int | None = None,
    *,
    run_id: str = RUN_ID,
    token: Token = TOKEN,
    heartbeat_timeout: float = 5.0,
    join_timeout: float = 30.0,
    diagnose_timeout: float = 3.0,
    tls: ssl.SSLContext | None = None,
    max_restarts: int | None = None,
    idle_timeout: float = 60.0,
    epoch: int = 0,
) -> AsyncIterator[CoordinatorServer]:
    server = CoordinatorServer(
        ServerConfig(
            RendezvousConfig(
                run_id=run_id,
                world_size=world_size,
                join_timeout=join_timeout,
                heartbeat_timeout=heartbeat_timeout,
                diagnose_timeout=diagnose_timeout,
                max_restarts=max_restarts,
            ),
            tick_interval=0.05,
            idle_timeout=idle_timeout,
            tls=tls,
            epoch=epoch,
        ),
        token,
    )
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.aclose()


def worker_config(
    server: CoordinatorServer, world_size: int, local_rank: int, **kw
) -> WorkerConfig:
    defaults = dict(
        coordinator=server.address,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=world_size,
        run_id=RUN_ID,
        token=TOKEN,
        node_id="node-a",
        join_timeout=20.0,
        connect_timeout=20.0,
        timeout=20.0,
    )
    defaults.update(kw)
    return WorkerConfig(**defaults)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def status_http(server: CoordinatorServer, **options: Any) -> AsyncIterator[str]:
    """The status server of ``server``'s job on loopback, for the block: its base URL."""
    http = StatusHTTP(server.rendezvous, **options)
    host, port = await http.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        await http.aclose()
