"""The plan handed to the processes a launcher starts, and the log they note into.

A launcher checks the plan and names it, and the log, in the environment of every
process it starts (:func:`chaos_env`); each rank's injector, each node's supervisor and
``shardwire chaos`` read the same log (:func:`read_log`). Kept apart from the injector
so that a launcher, which only hands the plan on, does not import what a rank injects
with.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardwire.worker.chaos import PLAN_VARIABLE
from shardwire.worker.chaos.plan import load

LOG_VARIABLE = "SHARDWIRE_CHAOS_LOG"
CLEAN_VARIABLE = "SHARDWIRE_CHAOS_CLEAN"  # "1": the plan's checks, none of its faults


def chaos_env(plan: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that hand the plan at ``plan`` (checked here: a bad plan stops the
    launch) to the processes a launcher starts, with the log they note into."""
    load(plan)
    path = str(Path(plan).absolute())
    log = environ.get(LOG_VARIABLE)  # ``shardwire chaos`` made a fresh one
    if not log:
        log = f"{path}.log"
        Path(log).write_text("")  # a new job: its faults all fire again
    return {PLAN_VARIABLE: path, LOG_VARIABLE: log}


def read_log(log: Path) -> list[dict[str, Any]]:
    """The entries of a chaos log (a line cut short by a kill is skipped)."""
    entries = []
    with contextlib.suppress(FileNotFoundError):
        for line in log.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    entries.append(entry)
    return entries


def fired_faults(log: Path) -> set[tuple[int, int]]:
    """The plan's faults (index, occurrence) the log says were injected already."""
    return fired_in(read_log(log))


def fired_in(entries: list[dict[str, Any]]) -> set[tuple[int, int]]:
    """The faults (index, occurrence) these log entries say were injected."""
    return {(e["fault"], e.get("occurrence", 0)) for e in entries if e.get("event") == "injected"}


def resume_later(seconds: float, pids: list[int]) -> None:
    """A process that sends SIGCONT to ``pids`` (a negative one: that process group) in
    ``seconds`` (a stopped process cannot)."""
    code = (
        "import contextlib, os, signal, sys, time\n"
        "time.sleep(float(sys.argv[1]))\n"
        "for p in sys.argv[2:]:\n"
        "    with contextlib.suppress(OSError):\n"
        "        os.kill(int(p), signal.SIGCONT)\n"
    )
    subprocess.Popen(  # noqa: S603 - our own interpreter and code, no shell
        [sys.executable, "-c", code, str(seconds), *map(str, pids)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
