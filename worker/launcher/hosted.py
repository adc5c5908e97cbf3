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
from shardwire.worker.chaos.supervise import coordinator_faults, note_coordinator_back
from shardwire.worker.launcher.options import LaunchSettings
from shardwire.worker.runtime.scratch import Scratch

_COORDINATOR_START_TIMEOUT = 30.0


def coordinator_command(
    settings: LaunchSettings, *, serve: bool = False, host: str = "127.0.0.1"
) -> list[str]:
    """The command line of the coordinator this node starts: with ``serve``, the job's
    (every address, ``--coordinator``'s port, every node); else one for this node's
    ``--nproc-per-node`` ranks on ``host``, any port."""
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
        where = ["--host", host, "--port", "0"]
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


# Restarts of a killed coordinator per job, at most: past them its death ends the job.
_COORDINATOR_RESTARTS = 10


class _Hosted:
    """The coordinator process, started again on the same address and state directory
    whenever a signal kills it while the job runs (its exit status otherwise is the job's
    end: 0 finished, 1 failed)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.state = Scratch("shardwire-coordinator-")  # dead launchers' swept
        self.command = [*command, "--state-dir", str(self.state.path)]
        self.env = {**os.environ, **env}
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ("", 0)
        self.closing = False
        self._pump: asyncio.Task[None] | None = None

    async def start(self) -> tuple[str, int]:
        command = self.command
        if self.address[1]:  # again: the address the ranks know
            at = command.index("--port")
            command = [*command[: at + 1], str(self.address[1]), *command[at + 2 :]]
        proc = self.proc = await asyncio.create_subprocess_exec(
            *command,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        async with asyncio.timeout(_COORDINATOR_START_TIMEOUT):
            first = (await proc.stderr.readline()).decode().strip()
        if "listening on" not in first:
            raise ShardwireError(f"the coordinator did not start: {first or 'no output'}")
        host, _, port = first.rsplit(" ", 1)[-1].rpartition(":")
        self.address = (host, int(port))
        print(f"[coordinator]: listening on {host}:{port}", file=sys.stderr, flush=True)
        self._pump = asyncio.create_task(_echo(proc.stderr, "[coordinator]: "))
        return self.address

    def pid(self) -> int:
        """The running coordinator's process id."""
        assert self.proc is not None
        return self.proc.pid

    async def watch(self) -> None:
        """Start the coordinator again each time a signal kills it (bounded)."""
        for _ in range(_COORDINATOR_RESTARTS):
            assert self.proc is not None
            code = await self.proc.wait()
            if self.closing or code >= 0:
                return
            print(
                f"[launch]: the coordinator was killed (signal {-code}); starting it again on "
                f"{self.address[0]}:{self.address[1]} from its journal",
                file=sys.stderr,
                flush=True,
            )
            await self._stop_pump()
            await self.start()
            note_coordinator_back(self.env, self.pid(), "started again")

    async def _stop_pump(self) -> None:
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)  # its stream ended
            self._pump = None

    async def stop(self) -> None:
        self.closing = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.terminate()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        self.state.remove()


@contextlib.asynccontextmanager
async def own_coordinator(
    command: list[str], env: dict[str, str], *, linger: float = 5.0
) -> AsyncIterator[tuple[str, int]]:
    """Run ``command`` (a coordinator) until the block ends, then give it ``linger``
    seconds to end by itself before stopping it; yields where it listens. It journals to
    a directory of its own, and a coordinator killed by a signal is started again there
    on the same address: the ranks ride out its absence."""
    hosted = _Hosted(command, env)
    watcher: asyncio.Task[None] | None = None
    chaos: asyncio.Task[None] | None = None
    try:
        address = await hosted.start()
        chaos = coordinator_faults(hosted.env, hosted.pid)  # None without a plan that says so
        watcher = asyncio.create_task(hosted.watch(), name="shardwire-coordinator-watch")
        yield address
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger):
                await asyncio.shield(watcher)
    finally:
        hosted.closing = True
        for task in (watcher, chaos):
            if task is not None:
                task.cancel()
                # The task's own cancellation ends here; the closer's would propagate.
                await asyncio.gather(task, return_exceptions=True)
        await hosted.stop()


async def _echo(stream: asyncio.StreamReader, prefix: str) -> None:
    while line := await stream.readline():
        print(prefix + line.decode(errors="replace").rstrip("\n"), file=sys.stderr, flush=True)
