"""Torch ranks forked from one fork server per test process (the launcher's own,
``shardwire.worker.launcher.forkserver``), not started as new interpreters: torch is
imported once per test process instead of once per rank (about 2.6 CPU-seconds a rank
here). Otherwise each rank starts as torchrun starts one: a session of its own, its own
environment and output files, its program run as ``__main__``; a rank's exit code is
what the server reports (negative: the signal that ended it)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

from shardwire.worker.bench.torchrun import clean_env
from shardwire.worker.launcher.forking import ANSWER_TIMEOUT, READY_TIMEOUT, server_command

IMPORTS = Path(__file__).resolve().parent / "rank_imports.py"


class ServerGone(RuntimeError):
    """The fork server ended or stopped answering."""


class RankServer:
    """A fork server with torch imported, and the ranks it forked that have not ended."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = server_command([sys.executable, "-u", str(IMPORTS)])
        self.proc = subprocess.Popen(  # noqa: S603 - this interpreter, the package's module
            command, stdin=theirs, env=clean_env()
        )
        theirs.close()
        self.sock = ours
        self.ids = itertools.count()
        self.running: dict[int, ForkedRank] = {}
        ready = self._report(READY_TIMEOUT)
        if ready != {"ready": 1}:  # a second Python thread: forking would copy its locks
            self.close()
            raise ServerGone(f"the fork server said {ready}, not that it is ready to fork")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _report(self, timeout: float) -> dict | None:
        """The server's next report, None if none came within ``timeout`` seconds."""
        self.sock.settimeout(max(timeout, 0.0))
        try:
            data = self.sock.recv(4096)
        except (TimeoutError, BlockingIOError):  # (a timeout of 0 makes it non-blocking)
            return None
        except OSError as error:
            raise ServerGone(f"the fork server is gone: {error}") from error
        if not data:
            raise ServerGone("the fork server closed its end")
        return json.loads(data)

    def _take(self, report: dict) -> None:
        if "exited" in report:
            rank = self.running.pop(report["exited"], None)
            if rank is not None:
                rank.returncode = report["code"]
        elif "refused" in report:
            raise ServerGone(f"the fork server refused an order: {report['why']}")

    def drain(self, timeout: float) -> None:
        """Read the reports that come within ``timeout`` seconds (at least the first)."""
        report = self._report(timeout)
        while report is not None:
            self._take(report)
            report = self._report(0.0)

    def start(
        self, argv: list[str], env: dict[str, str], out: BinaryIO, err: BinaryIO
    ) -> ForkedRank:
        """Fork ``argv`` (this interpreter, then the program and its arguments) as a rank
        with ``env``, its output to ``out`` and ``err``."""
        if argv[0] != sys.executable:
            raise ValueError(f"a forked rank runs in this interpreter, not {argv[0]}")
        number = next(self.ids)
        order = json.dumps({"id": number, "env": env, "argv": argv[1:]}).encode()
        socket.send_fds(self.sock, [order], [out.fileno(), err.fileno()])
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while (report := self._report(deadline - time.monotonic())) is not None:
            if report.get("started") == number:
                rank = ForkedRank(self, report["pid"])
                self.running[rank.pid] = rank
                return rank
            self._take(report)
        raise ServerGone(f"the fork server did not start {argv[1:]} in {ANSWER_TIMEOUT:.0f} s")

    def close(self) -> None:
        self.sock.close()  # the server exits when its end closes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


class ForkedRank:
    """A rank the server forked, watched as ``subprocess.Popen`` is (``run_ranks``)."""

    def __init__(self, server: RankServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.drain(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while self.returncode is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            self.server.drain(min(left, 60.0))
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not reported ended: its pid is still this rank's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)  # it leads a session of its own


_server: RankServer | None = None


def start(argv: list[str], env: dict[str, str], out: BinaryIO, err: BinaryIO) -> ForkedRank:
    """A rank forked from this test process's server (started at the first rank)."""
    global _server  # noqa: PLW0603 - one server per test process, for every test in it
    if _server is None or not _server.alive():
        _server = RankServer()
    return _server.start(argv, env, out, err)
