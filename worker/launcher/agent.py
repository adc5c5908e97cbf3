"""The node agent behind ``shardwire worker`` and ``shardwire launch``.

The agent joins the coordinator for its node (``NodeJoin``), learns its node rank, and
only then starts its processes, so each child has ``RANK`` from the start (torchrun's
contract). It stays connected: an abort from the coordinator is echoed in the summary.
For ``--standalone`` it first starts a coordinator subprocess on 127.0.0.1 with a fresh
random token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from collections.abc import AsyncIterator

from shardwire.protocol import ShardwireError
from shardwire.protocol.auth import load_token
from shardwire.protocol.messages import Abort, NodeJoin
from shardwire.worker.control import ControlClient
from shardwire.worker.launcher.settings import LaunchSettings
from shardwire.worker.launcher.supervisor import Launch, Supervisor
from shardwire.worker.tls import TlsFiles
from shardwire.worker.transport import shm

_COORDINATOR_START_TIMEOUT = 30.0


def _token_env(settings: LaunchSettings) -> dict[str, str]:
    token = settings.token.get_secret_value() if settings.token else None
    if not token and settings.token_file:
        with open(settings.token_file, encoding="utf-8") as fh:
            token = fh.readline().strip()
    return {"SHARDWIRE_TOKEN": token} if token else {}


@contextlib.asynccontextmanager
async def standalone_coordinator(
    settings: LaunchSettings, env: dict[str, str]
) -> AsyncIterator[tuple[str, int]]:
    """Run ``python -m shardwire.coordinator`` on 127.0.0.1 with an ephemeral port."""
    world = settings.nproc_per_node
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shardwire.coordinator",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--world-size",
        str(world),
        "--run-id",
        settings.run_id,
        "--join-timeout",
        str(settings.join_timeout),
        "--heartbeat-timeout",
        str(settings.heartbeat_timeout),
        "--http-port",
        "0",
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


async def run_node(settings: LaunchSettings, argv: list[str]) -> int:
    """Join as this node's agent, run the processes, and report how they ended."""
    env = _token_env(settings)
    tls = settings.tls_files()
    if tls is not None:  # the coordinator and the workers read the files from there
        env.update(tls.env())
    if settings.standalone:
        # A fresh random token unless the user gave one: any local process could join or
        # read a job that has none. It reaches the coordinator and the workers through
        # their environment, never a command line.
        env.setdefault("SHARDWIRE_TOKEN", secrets.token_hex(32))
        async with standalone_coordinator(settings, env) as address:
            return await _agent(settings, argv, address, env)
    return await _agent(settings, argv, settings.coordinator_address(), env)


async def _agent(
    settings: LaunchSettings, argv: list[str], address: tuple[str, int], env: dict[str, str]
) -> int:
    node_id = settings.node_id or socket.gethostname()
    supervisor: Supervisor | None = None

    def on_abort(msg: Abort | None) -> None:
        if supervisor is None:
            return
        if msg is None:
            supervisor.note_lost_coordinator(f"{address[0]}:{address[1]}")
        else:
            supervisor.note_abort(msg.rank, msg.reason, msg.traceback, msg.stacks)

    token = load_token(env.get("SHARDWIRE_TOKEN"), None)
    tls = TlsFiles.from_env(env)
    control = ControlClient(
        token=token,
        run_id=settings.run_id,
        role="agent",
        on_abort=on_abort,
        tls=tls.client_context() if tls else None,
    )
    try:
        await control.connect(*address, timeout=min(settings.join_timeout, 60.0))
        control.start_heartbeats(1.0)
        nproc = settings.nproc_per_node
        assignment = await control.node_join(
            NodeJoin(
                world_size=settings.nnodes * nproc if not settings.standalone else nproc,
                node_id=node_id,
                local_world_size=nproc,
            ),
            timeout=settings.join_timeout,
        )
        child_env = {
            **os.environ,
            **env,
            "MASTER_ADDR": address[0],
            "MASTER_PORT": str(address[1]),
            "SHARDWIRE_RUN_ID": settings.run_id,
            "SHARDWIRE_JOIN_TIMEOUT": str(settings.join_timeout),
            "SHARDWIRE_STALL_WARN": str(settings.stall_warn),
            # rank 0 draws a progress bar only when the person at the terminal sees it
            "SHARDWIRE_INTERACTIVE": "1" if sys.stdout.isatty() else "0",
        }
        if settings.bind_host:
            child_env["SHARDWIRE_BIND_HOST"] = settings.bind_host
        if settings.advertise_host:
            child_env["SHARDWIRE_ADVERTISE_HOST"] = settings.advertise_host
        if settings.insecure:
            child_env["SHARDWIRE_INSECURE"] = "1"
        supervisor = Supervisor(
            Launch(
                argv=argv,
                env=child_env,
                node_id=node_id,
                node_rank=assignment.node_rank,
                nproc=nproc,
                world_size=assignment.world_size,
                term_timeout=settings.term_timeout,
            )
        )
        try:
            code = await _supervise(supervisor)
        finally:  # the workers are gone: remove the segments a killed one left named
            if swept := shm.sweep(settings.run_id):
                print(f"[agent]: removed {swept} shared-memory segment(s) left by workers",
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        await control.aclose()
    if code != 0:
        print(supervisor.summary(), file=sys.stderr, flush=True)
    return code


async def _supervise(supervisor: Supervisor) -> int:
    loop = asyncio.get_running_loop()
    stop_tasks: set[asyncio.Task[None]] = set()
    received: list[int] = []

    def forward(sig: int) -> None:
        received.append(sig)
        supervisor.interrupted_by = supervisor.interrupted_by or sig
        task = asyncio.ensure_future(supervisor.stop(sig))
        stop_tasks.add(task)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    try:
        code = await supervisor.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in stop_tasks:
            await task
    return 128 + received[0] if received else code
