"""Fault injection for whole jobs: an in-process coordinator (with its HTTP views) and
N worker processes of a test script, which a test can stop, kill or wait on.

Every process is started here and killed here (by PID) when the job ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardwire.coordinator import CoordinatorServer
from shardwire.coordinator.http import StatusHTTP
from shardwire.protocol import Token
from tests.worker.cluster import coordinator

from .cli import ROOT, SCRIPTS, env

TOKEN = "faults-token"
# this test process's jobs' run id: its shared-memory names are its own (a test process
# beside it runs jobs of its own, whose live segments its checks must not count)
RUN_ID = f"faults-{os.getpid()}"


@dataclass
class Worker:
    rank: int
    proc: asyncio.subprocess.Process
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    exited_at: float | None = None
    watcher: asyncio.Task[None] | None = None
    lines: asyncio.Queue[str] = field(default_factory=asyncio.Queue)  # stdout, unread

    async def line(self, pattern: str, *, timeout: float = 60.0) -> str:
        """Wait for a stdout line matching ``pattern`` (bounded)."""
        async with asyncio.timeout(timeout):
            while True:
                text = await self.lines.get()
                if re.search(pattern, text):
                    return text

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            os.kill(self.proc.pid, sig)


@dataclass
class Job:
    server: CoordinatorServer
    http: StatusHTTP
    workers: list[Worker]

    async def wait(self, ranks: list[int] | None = None, *, timeout: float = 90.0) -> None:
        """Wait until the given ranks (default all) have exited."""
        chosen = [w for w in self.workers if ranks is None or w.rank in ranks]
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(w.watcher for w in chosen if w.watcher is not None))

    def url(self, path: str) -> str:
        host, port = self.http.address
        return f"http://{host}:{port}{path}"


async def _pump(worker: Worker, stream: asyncio.StreamReader, sink: list[str], queue: bool):
    while raw := await stream.readline():
        text = raw.decode(errors="replace").rstrip("\n")
        sink.append(text)
        if queue:
            worker.lines.put_nowait(text)


async def _watch(worker: Worker) -> None:
    assert worker.proc.stdout is not None and worker.proc.stderr is not None
    await asyncio.gather(
        _pump(worker, worker.proc.stdout, worker.out, True),
        _pump(worker, worker.proc.stderr, worker.err, False),
    )
    await worker.proc.wait()
    worker.exited_at = time.monotonic()


@contextlib.asynccontextmanager
async def job(
    world: int,
    script: str = "steps.py",
    *,
    heartbeat_timeout: float = 5.0,
    diagnose_timeout: float = 3.0,
    **variables: str,
) -> AsyncIterator[Job]:
    """Run ``world`` processes of ``tests/e2e/scripts/<script>`` against a coordinator."""
    async with coordinator(
        world,
        run_id=RUN_ID,
        token=Token(TOKEN),
        heartbeat_timeout=heartbeat_timeout,
        join_timeout=120.0,
        diagnose_timeout=diagnose_timeout,
    ) as server:
        http = StatusHTTP(server.rendezvous)
        await http.start("127.0.0.1", 0)
        try:
            async with _workers(world, script, server.address, variables) as workers:
                yield Job(server, http, workers)
        finally:
            await http.aclose()


@contextlib.asynccontextmanager
async def _workers(
    world: int, script: str, address: tuple[str, int], variables: dict[str, str]
) -> AsyncIterator[list[Worker]]:
    host, port = address
    workers: list[Worker] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        for rank in range(world):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(SCRIPTS / script),
                env=env(
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR=host,
                    MASTER_PORT=str(port),
                    SHARDWIRE_RUN_ID=RUN_ID,
                    SHARDWIRE_TOKEN=TOKEN,
                    SHARDWIRE_NODE_ID="node-a",
                    OMP_NUM_THREADS="1",
                    OPENBLAS_NUM_THREADS="1",
                    **variables,
                ),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=ROOT,
            )
            workers.append(Worker(rank, proc))
        for w in workers:
            w.watcher = asyncio.create_task(_watch(w))
            tasks.append(w.watcher)
        yield workers
    finally:
        for w in workers:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                    os.kill(w.proc.pid, signal.SIGKILL)
        for w in workers:
            await w.proc.wait()
        await asyncio.gather(*tasks, return_exceptions=True)  # the pipes are closed now
