"""The coordinator a node starts itself: ``shardwire launch --standalone`` (127.0.0.1, any
port, one node) and the first node of a scheduler's job (every address, the port the
scheduler's place says, the whole job)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

from shardwire.protocol import ShardwireError
from shardwire.worker.chaos.supervise import coordinator_faults
from shardwire.worker.launcher.options import LaunchSettings

_COORDINATOR_START_TIMEOUT = 30.0


def coordinator_command(settings: LaunchSettings, *, serve: bool = False) -> list[str]:
    """The command line of the coordinator this node starts: with ``serve``, the job's
    (every address, ``--coordinator``'s port, every node); else the standalone one."""
    if serve:
        low, high = settings.node_range
        _, port = settings.coordinator_address()
        where = ["--host", "0.0.0.0", "--port", str(port)]
        size = (
            ["--world-size", str(high * settings.nproc_per_node)]
            if low == high
            else ["--nnodes", settings.nnodes]
        )
    else:
        where = ["--host", "127.0.0.1", "--port", "0"]
        size = ["--world-size", str(settings.nproc_per_node)]
    return [
        sys.executable,
        "-m",
        "shardwire.coordinator",
        *where,
        *size,
        "--run-id",
        settings.run_id,
        "--join-timeout",
        str(settings.join_timeout),
        "--heartbeat-timeout",
        str(settings.heartbeat_timeout),
        "--http-port",
        "0",
        "--max-restarts",
        str(settings.max_restarts),
    ]


@contextlib.asynccontextmanager
async def own_coordinator(
    command: list[str], env: dict[str, str], *, linger: float = 5.0
) -> AsyncIterator[tuple[str, int]]:
    """Run ``command`` (a coordinator) until the block ends, then give it ``linger``
    seconds to end by itself before stopping it; yields where it listens."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        env={**os.environ, **env},
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    pump: asyncio.Task[None] | None = None
    chaos: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(_COORDINATOR_START_TIMEOUT):
            first = (await proc.stderr.readline()).decode().strip()
        if "listening on" not in first:
            raise ShardwireError(f"the coordinator did not start: {first or 'no output'}")
        host, _, port = first.rsplit(" ", 1)[-1].rpartition(":")
        print(f"[coordinator]: listening on {host}:{port}", file=sys.stderr, flush=True)
        pump = asyncio.create_task(_echo(proc.stderr, "[coordinator]: "))
        # None without a plan that says so
        chaos = coordinator_faults({**os.environ, **env}, proc.pid)
        yield host, int(port)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger):
                await proc.wait()
    finally:
        if proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for task in (pump, chaos):
            if task is not None:
                task.cancel()
                # The task's own cancellation ends here; the closer's would propagate.
                await asyncio.gather(task, return_exceptions=True)


async def _echo(stream: asyncio.StreamReader, prefix: str) -> None:
    while line := await stream.readline():
        print(prefix + line.decode(errors="replace").rstrip("\n"), file=sys.stderr, flush=True)
