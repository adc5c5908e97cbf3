"""Helpers to run the ``shardwire`` command from tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
