"""``shardwire launch --standalone``: a coordinator subprocess on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator

from shardwire.protocol import ShardwireError
from shardwire.worker.launcher.settings import LaunchSettings

_COORDINATOR_START_TIMEOUT = 30.0


def coordinator_command(settings: LaunchSettings) -> list[str]:
    """The standalone coordinator's command line: one node of ``--nproc-per-node``."""
    return [
        sys.executable,
        "-m",
        "shardwire.coordinator",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--world-size",
        str(settings.nproc_per_node),
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
async def standalone_coordinator(
    settings: LaunchSettings, env: dict[str, str]
) -> AsyncIterator[tuple[str, int]]:
    """Run ``python -m shardwire.coordinator`` on 127.0.0.1 with an ephemeral port."""
    proc = await asyncio.create_subprocess_exec(
        *coordinator_command(settings),
        env={**os.environ, **env},
        stdin=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    pump: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(_COORDINATOR_START_TIMEOUT):
            first = (await proc.stderr.readline()).decode().strip()
        if "listening on" not in first:
            raise ShardwireError(f"the coordinator did not start: {first or 'no output'}")
        host, _, port = first.rsplit(" ", 1)[-1].rpartition(":")
        print(f"[coordinator]: listening on {host}:{port}", file=sys.stderr, flush=True)
        pump = asyncio.create_task(_echo(proc.stderr, "[coordinator]: "))
        yield host, int(port)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
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
        if pump is not None:
            pump.cancel()
            # The pump's own cancellation ends here; the closer's would propagate.
            await asyncio.gather(pump, return_exceptions=True)


async def _echo(stream: asyncio.StreamReader, prefix: str) -> None:
    while line := await stream.readline():
        print(prefix + line.decode(errors="replace").rstrip("\n"), file=sys.stderr, flush=True)
