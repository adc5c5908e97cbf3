"""A node agent's side of its fork server (``launcher.forkserver``): the agent starts the
server as the node starts, so that its imports run while the node joins, then asks it
for each rank process and watches what it forked as it would a process of its own.

:class:`ForkServer` owns the server process, the socket to it and the task that reads
its reports. :meth:`ForkServer.fork` gives a :class:`Forked` (``pid``, ``stdout`` and
``stderr`` stream readers, ``returncode``, ``wait()``: what the supervisor reads of a
process), or None where the server cannot serve: it did not say it was ready within
``READY_TIMEOUT``, it runs a Python thread besides its own after its imports, it refused
the order
or it is gone. The supervisor then starts that process itself. If the server dies while
ranks it forked run, nobody can tell how they end: they are killed (SIGKILL to their
process groups) and reported so, and the node goes on without a server.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
from typing import TextIO

from shardwire.worker.launcher.exits import Exited, ended_how, process_state

READY_TIMEOUT = 120.0  # seconds for the server's imports (torch on a loaded machine)
ANSWER_TIMEOUT = 30.0  # seconds for the server to answer an order
CLOSE_TIMEOUT = 10.0  # seconds for the server to exit once its socket closed
REPORT_BYTES = 4096  # the largest report read (one JSON object)


def server_command(rank_argv: list[str]) -> list[str]:
    """The fork server's command line for ranks started as ``rank_argv`` (python, ``-u``,
    then the script or ``-m`` and its module, then the arguments): the same python, told
    the script (or module) whose imports it makes ahead."""
    rest = rank_argv[2:]  # past the python and -u
    script = rest[:2] if rest[:1] == ["-m"] else rest[:1]
    return [rank_argv[0], "-u", "-m", "shardwire.worker.launcher.forkserver", *script]


class Forked:
    """A rank process the fork server started (not this process's child: the server
    reaps it and reports how it ended)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.returncode: int | None = None  # as asyncio gives it (negative: the signal)
        self._done = asyncio.Event()

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set()

    def exited(self) -> Exited | None:
        """How it ended, told before the server's report is read; None while it runs."""
        if self.returncode is not None:
            return Exited(self.returncode)
        return Exited(None) if process_state(self.pid) in ("", "Z", "X") else None


class ForkServer:
    """One node's fork server, started by ``argv`` with ``env``; notes go to ``err``."""

    def __init__(self, argv: list[str], env: dict[str, str], *, err: TextIO) -> None:
        self.argv = argv
        self.env = env
        self._err = err
        self.proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._starting: asyncio.Task[bool] | None = None  # until it says it is ready
        self._reader: asyncio.Task[None] | None = None  # its reports, while it serves
        self._answers: dict[int, asyncio.Future[Forked | None]] = {}  # by order number
        self._running: dict[int, Forked] = {}  # by pid
        self._numbers = itertools.count()
        self._closing = False

    def start(self) -> None:
        """Start the server (its imports run from now on)."""
        if self._starting is None:
            self._starting = asyncio.create_task(self._start())

    def _say(self, line: str) -> None:
        self._err.write(f"[agent]: {line}\n")
        self._err.flush()

    async def _start(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=theirs.fileno(),
                stdout=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            self._say(f"cannot start the fork server ({exc}): each rank starts on its own")
            return False
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                data = await asyncio.get_running_loop().sock_recv(ours, REPORT_BYTES)
            threads = json.loads(data)["ready"] if data else None
        except (TimeoutError, OSError, ValueError, KeyError, TypeError):
            threads = None
        if threads == 1:
            self._reader = asyncio.create_task(self._read())
            return True
        if isinstance(threads, int):
            why = f"runs {threads} Python threads after its imports (a fork copies one)"
        elif self.proc.returncode is not None:
            why = f"ended before it was ready ({ended_how(self.proc.returncode)})"
        else:
            why = f"did not say it was ready within {READY_TIMEOUT:.0f} s"
        self._say(f"the fork server (pid {self.proc.pid}) {why}: each rank starts on its own")
        await self._stop_server()
        return False

    async def fork(self, env: dict[str, str], argv: list[str]) -> Forked | None:
        """A rank process running ``argv`` (a script and its arguments, or ``-m`` and a
        module's) with ``env``, forked by the server; None where it cannot serve."""
        if self._starting is None or not await self._starting:
            return None
        sock, reader = self._sock, self._reader
        if sock is None or reader is None or reader.done():
            return None
        number = next(self._numbers)
        answer: asyncio.Future[Forked | None] = asyncio.get_running_loop().create_future()
        self._answers[number] = answer
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            order = json.dumps({"id": number, "env": env, "argv": argv}).encode()
            fds = array.array("i", [out_w, err_w])
            sock.sendmsg([order], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            async with asyncio.timeout(ANSWER_TIMEOUT):
                proc = await answer
        except (OSError, TimeoutError) as exc:
            self._say(f"the fork server did not start a rank ({exc!r}): it starts on its own")
            proc = None
        finally:
            self._answers.pop(number, None)
            os.close(out_w)
            os.close(err_w)
        if proc is None:
            os.close(out_r)
            os.close(err_r)
            return None
        proc.stdout = await _stream(out_r)
        proc.stderr = await _stream(err_r)
        return proc

    async def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(sock, REPORT_BYTES):  # until the server ends
                self._take(json.loads(data))
        except (OSError, ValueError) as exc:
            if not self._closing:
                self._say(f"the fork server's reports broke off ({exc!r})")
        finally:
            self._lost()

    def _take(self, report: dict) -> None:
        if "exited" in report:
            proc = self._running.pop(report["exited"], None)
            if proc is not None:
                proc.end(report["code"])
        elif "started" in report:
            proc = Forked(report["pid"])
            self._running[proc.pid] = proc
            answer = self._answers.get(report["started"])
            if answer is not None and not answer.done():
                answer.set_result(proc)
            else:  # the order was given up on: nobody will watch this process
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        elif "refused" in report:
            self._say(f"the fork server refused an order: {report.get('why')}")
            answer = self._answers.get(report["refused"])
            if answer is not None and not answer.done():
                answer.set_result(None)

    def _lost(self) -> None:
        """The server's reports ended: no answer will come, and how the ranks it forked
        end cannot be told (unless the node is done with them: they have all ended)."""
        for answer in self._answers.values():
            if not answer.done():
                answer.set_result(None)
        running, self._running = list(self._running.values()), {}
        if running and not self._closing:
            pid = self.proc.pid if self.proc is not None else "?"
            self._say(
                f"the fork server (pid {pid}) ended: the {len(running)} rank process(es) "
                "it forked are killed, as how they end can no longer be told"
            )
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.end(-signal.SIGKILL)

    async def aclose(self) -> None:
        """Stop the server (once the node's ranks have ended)."""
        self._closing = True
        for task in (self._starting, self._reader):
            if task is not None and not task.done():
                task.cancel()
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        await self._stop_server()

    async def _stop_server(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the server exits when its end reads closed
            self._sock = None
        proc = self.proc
        if proc is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await proc.wait()


async def _stream(fd: int) -> asyncio.StreamReader:
    """A stream reader over the read end ``fd`` of a pipe (which it then owns)."""
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader
