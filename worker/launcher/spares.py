"""A node agent's warm spare (live recovery): one process started ahead of any failure,
interpreter up and shardwire imported (``launcher.spare``), that becomes a failed rank's
replacement when told the rank's environment and arguments on its input.

The agent owns it: :meth:`WarmSpare.start` starts one (after a delay, in a task this
object owns), :meth:`WarmSpare.take` hands it over as a rank's process, and
:meth:`WarmSpare.drop` kills it and cancels a pending start. It leads its own process
group, like a rank's process, and gets none of the signals meant for the ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal


class WarmSpare:
    """At most one spare process of a node, started by ``argv`` with ``env``."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None  # waiting to become a rank
        self._task: asyncio.Task[None] | None = None  # starts the next one
        self._dropped = False

    def start(self, delay: float) -> None:
        """Start a spare ``delay`` seconds from now (its imports would take a core from
        ranks that are recovering), unless one waits or is about to start."""
        if self._dropped or self.proc is not None or (self._task and not self._task.done()):
            return
        self._task = asyncio.create_task(self._start(delay))

    async def _start(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self._dropped and self.proc is None:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )

    async def take(self, env: dict[str, str], argv: list[str]) -> asyncio.subprocess.Process | None:
        """The spare, now running ``argv`` (a script and its arguments, or ``-m`` and a
        module's) with ``env``; None if no spare is alive (start the process anew)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.returncode is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(json.dumps({"env": env, "argv": argv}).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            await kill_group(proc)
            return None
        return proc

    async def drop(self) -> None:
        """Kill the spare and cancel a pending start: the node is done."""
        self._dropped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        proc, self.proc = self.proc, None
        if proc is not None:
            await kill_group(proc)


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL a process's group (a process that has not started its work yet: an idle
    spare, or a replacement the job no longer wants) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            await proc.wait()
