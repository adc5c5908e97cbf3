"""``shardwire chaos PLAN -- COMMAND``: run a job with a fault plan, then judge it.

The plan is checked before anything starts (a bad field is one line naming it, exit
status 2). The command (``shardwire launch ...``, ``shardwire worker ...``) runs as a
child with the plan's path in ``SHARDWIRE_CHAOS`` and a fresh chaos log in
``SHARDWIRE_CHAOS_LOG``, so the ranks it starts inject their own faults. SIGINT and
SIGTERM are passed on to it. When it ends, the verdict is printed, written as JSON
(``--verdict``), and the exit status says whether the plan's expectation and the
invariants held (0) or not (1).

With ``compare = "clean"`` the command first runs without faults (the ranks only note
their state, ``SHARDWIRE_CHAOS_CLEAN=1``), then with them. ``{run}`` in the command
becomes ``clean`` or ``faulty``, so the two runs can keep their run and checkpoint
directories apart (the faulty one must not resume from the clean one's checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from shardwire.worker.chaos import PLAN_VARIABLE
from shardwire.worker.chaos.faultlog import CLEAN_VARIABLE, LOG_VARIABLE, read_log
from shardwire.worker.chaos.plan import PlanError, load
from shardwire.worker.chaos.verdict import table, verdict


def run(plan_path: str, command: list[str], verdict_path: str | None) -> int:
    try:
        plan = load(plan_path)
    except PlanError as exc:
        print(f"shardwire chaos: {exc}", file=sys.stderr)
        return 2
    if not command:
        print("shardwire chaos: give the job's command after --", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="shardwire-chaos-") as scratch:
        clean = None
        if plan.compare == "clean":
            print("shardwire chaos: the clean run (no faults) first", file=sys.stderr, flush=True)
            code, clean, _started, _finished = _job(plan_path, command, Path(scratch), "clean")
            if code is None:
                return 2
            if code != 0:
                print(
                    f"shardwire chaos: the clean run failed (exit status {code}): nothing "
                    "to compare with",
                    file=sys.stderr,
                )
                return 1
            print("shardwire chaos: the run with faults", file=sys.stderr, flush=True)
        code, entries, started, finished = _job(plan_path, command, Path(scratch), "faulty")
        if code is None:
            return 2
        outcome = verdict(plan, entries, code, started, finished, clean=clean)
    print(table(outcome), file=sys.stderr, flush=True)
    if verdict_path:
        Path(verdict_path).write_text(json.dumps(outcome, indent=2))
    for path in {e["path"] for e in entries if e.get("event") == "summary"}:
        _add_to_summary(Path(path), outcome)
    return 0 if outcome["held"] else 1


def _add_to_summary(path: Path, outcome: dict[str, Any]) -> None:
    """The verdict as the ``chaos`` section of the run's summary (written whole)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"shardwire chaos: cannot add the verdict to {path}: {exc}", file=sys.stderr)
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({**summary, "chaos": outcome}, indent=2))
    os.replace(partial, path)


def _job(
    plan_path: str, command: list[str], scratch: Path, run: str
) -> tuple[int | None, list[dict[str, Any]], float, float]:
    """Run ``command`` (``{run}`` in it replaced by ``run``) with the plan: its faults, or
    for the clean run only its checks. Returns the exit status (None: it could not
    start), the chaos log's entries, and when it started and ended."""
    log = scratch / f"{run}.jsonl"
    env = {
        **os.environ,
        PLAN_VARIABLE: str(Path(plan_path).absolute()),
        LOG_VARIABLE: str(log),
        CLEAN_VARIABLE: "1" if run == "clean" else "0",
    }
    argv = [arg.replace("{run}", run) for arg in command]
    started = time.time()
    try:
        child = subprocess.Popen(argv, env=env)  # noqa: S603 - the user's own command
    except OSError as exc:
        print(f"shardwire chaos: cannot start {argv[0]}: {exc}", file=sys.stderr)
        return None, [], started, started
    forwarded = {sig: signal.signal(sig, _forward(child)) for sig in _FORWARDED}
    try:
        code = child.wait()
    finally:
        for sig, previous in forwarded.items():
            signal.signal(sig, previous)
    return code, read_log(log), started, time.time()


_FORWARDED = (signal.SIGINT, signal.SIGTERM)


def _forward(child: subprocess.Popen) -> Callable[[int, FrameType | None], None]:
    def handler(sig: int, _frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(sig)

    return handler


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire chaos`` before its ``--``."""
    p = argparse.ArgumentParser(
        prog="shardwire chaos",
        usage="shardwire chaos PLAN [--verdict PATH] -- COMMAND ...",
        description=__doc__,
        epilog="example:\n  shardwire chaos kill.toml --verdict verdict.json -- "
        "shardwire launch --standalone --nproc-per-node 4 train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", help="the fault plan (TOML, or YAML)")
    p.add_argument("--verdict", help="also write the verdict here, as JSON")
    return p


def main(argv: list[str]) -> int:
    if "--" in argv:
        at = argv.index("--")
        own, command = argv[:at], argv[at + 1 :]
    else:
        own, command = argv, []
    args = parser().parse_args(own)
    return run(args.plan, command, args.verdict)
