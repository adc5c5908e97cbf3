"""Helpers to run the ``shardwire`` command from tests."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
SHARDWIRE = str(Path(sys.executable).parent / "shardwire")


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
    return {**base, **extra}


def run(
    command: list[str], *, cwd: Path = ROOT, timeout: float = 90, **extra: str
) -> subprocess.CompletedProcess:
    """``command`` run as a user runs it: in ``cwd``, the environment plus ``extra``."""
    return subprocess.run(
        command,
        check=False,
        env=env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def shardwire(*args: str, timeout: float = 90, **extra: str) -> subprocess.CompletedProcess:
    return run([SHARDWIRE, *args], timeout=timeout, **extra)


def background(*args: str, **extra: str) -> subprocess.Popen:
    """``shardwire ARGS`` in the background, output piped as text."""
    return subprocess.Popen(
        [SHARDWIRE, *args],
        env=env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def start_coordinator(*args: str, **extra: str) -> tuple[subprocess.Popen, str]:
    """``shardwire coordinator --port 0 ARGS`` in the background; returns it and its port."""
    proc = subprocess.Popen(
        [SHARDWIRE, "coordinator", "--port", "0", *args],
        env=env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "shardwire coordinator listening on HOST:PORT"
    return proc, line.strip().rsplit(":", 1)[1]


def run_records(run: Path) -> tuple[dict, dict]:
    """A run directory's logged (loss, lr, accuracy) by step, and its summary."""
    records = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = (record["loss"], record["lr"], record["accuracy"])
    return records, json.loads((run / "summary.json").read_text())


class Lines:
    """A stream of a process's output read line by line on a thread of its own, so a
    test waits for a line with a bound (a blocked ``readline`` has none). The thread ends
    when the stream does (the process ended or was killed)."""

    def __init__(self, stream: IO[str] | None, beside: Lines | None = None) -> None:
        assert stream is not None
        self.beside = beside  # the process's other stream, shown when a wait fails
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._ended = False
        threading.Thread(target=self._read, args=(stream,), daemon=True, name="lines").start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def until(self, text: str, *, count: int = 1, timeout: float = 60.0) -> list[str]:
        """The lines read until ``count`` of them (since the last call) hold ``text``;
        AssertionError, with the lines seen, after ``timeout`` s or at the stream's end."""
        deadline, found, lines = time.monotonic() + timeout, 0, []
        while found < count:
            left = deadline - time.monotonic()
            try:
                line = None if self._ended else self._queue.get(timeout=max(left, 0.0))
            except queue.Empty:
                raise AssertionError(
                    f"{found} of {count} lines with {text!r} within {timeout:g} s; "
                    f"read: {self._said()}"
                ) from None
            if line is None:
                self._ended = True
                raise AssertionError(
                    f"the output ended after {found} of {count} lines with {text!r}: {self._said()}"
                )
            self.seen.append(line)
            lines.append(line)
            found += text in line
        return lines

    def _said(self) -> str:
        beside = self.beside
        if beside is not None:
            time.sleep(0.5)  # what it says as it fails may come a moment later
            beside.drain()
        other = "" if beside is None else f"\nbeside it: {''.join(beside.seen[-40:])}"
        return "".join(self.seen[-40:]) + other

    def drain(self) -> None:
        """Take in what has been read so far (shown when a wait on the other stream fails)."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self._ended = True
                return
            self.seen.append(line)
