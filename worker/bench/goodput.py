"""Goodput under failures: charlm on N local ranks with a seeded random fault every F
seconds, beside the same job without faults, in one invocation (run in a checkout).

    shardwire bench goodput [--nproc 4] [--every 30] [--minutes 5] [--recovery both]
    shardwire bench goodput --torch ddp --pairs 3 --every 20 --minutes 2

``--torch ddp`` (or ``fsdp2``) trains torch charlm (``examples/torch_charlm.py``) over
the shardwire backend instead of shardwire's own layers: ``relaunch`` resumes from its
``torch.distributed.checkpoint`` on disk, ``live`` from ``shardwire.torch.PeerStorage``.
``--pairs K`` alternates K fault-free runs with K faulty ones (this machine is noisy):
each pair's goodput is its faulty run over its own fault-free run, and each mode reports
the median and range over the pairs. ``--compare-torchft`` (with ``--torch ddp``) times,
in each pair, the same steps and kill schedule recovered the ways torch users recover
them today: torchft (a lighthouse, a replica group per rank, a restarted replica healing
from a live peer) and ``torchrun --max-restarts`` over gloo from the checkpoint on disk,
each against its own fault-free run (``--torchft-python``: an interpreter with torchft
and shardwire, ``pip install torchft-nightly`` and this checkout). A line per stage on
standard error (a bar on a terminal) says what runs and about how long is left.

The fault-free job trains for ``--minutes`` and sets the number of steps; each faulty
one trains the same steps under ``shardwire chaos`` with a plan that hits a random rank
every ``--every`` seconds on average (SIGKILL by default, ``--kind``), the same plan for
each recovery mode (``--recovery``): ``relaunch`` starts every process again from the
latest checkpoint (``--save-every``); ``live`` starts only the failed rank again while
the others re-form in their processes, and every rank rolls back to the peers'
in-memory copies (``--copy-every``). Goodput is the fault-free wall time over the faulty
one for the same steps (1.0: the faults cost nothing); the time lost per fault is the
difference over the faults. Per fault, from the chaos verdict: how long until the job
trained again (recovery) and how many steps it computed twice (steps lost); and how
many worker processes the job started in all. The JSON holds each mode's under
``modes``, and the first mode's ``goodput``, ``steps_lost`` and ``recovery_s`` at the top
(``mode`` names it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import command_line, example
from shardwire.worker.bench.peers import PeerRun, torchft_job, torchft_python, torchrun_job
from shardwire.worker.bench.stages import Stages
from shardwire.worker.chaos.plan import load

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
SHAPE = ["--batch=16", "--context=32", "--dim=64", "--heads=4", "--layers=2"]


def _workload(args: Any) -> tuple[Path, list[str]]:
    """The script and its model's flags: shardwire's charlm, or torch charlm."""
    if args.torch:
        return example("torch_charlm.py"), [*SHAPE, f"--wrap={args.torch}"]
    return example("charlm.py"), [*SHAPE, "--log-every=10"]


# A job's command line for run directory ``work``, launcher flags first: shardwire
# launch's by default, shardwire ray's for the benchmark on Ray.
JobCommand = Callable[[Path, list[str]], list[str]]


def launched(script: Path, model: list[str], nproc: int) -> JobCommand:
    """``shardwire launch --standalone`` of ``nproc`` ranks of ``script`` with ``model``."""

    def command(work: Path, flags: list[str]) -> list[str]:
        head = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", str(nproc)]
        return [*head, "--run-id", f"goodput-{work.name}", *flags, *dirs(script, model, work)]

    return command


def dirs(script: Path, model: list[str], work: Path) -> list[str]:
    """The script, its model's flags and where it writes, under ``work``."""
    return [
        str(script),
        *model,
        f"--run-dir={work / 'run'}",
        f"--checkpoint-dir={work / 'checkpoints'}",
    ]


def _run(command: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.monotonic()
    done = subprocess.run(  # noqa: S603 - our own command line
        command, capture_output=True, text=True, timeout=timeout, check=False
    )
    return time.monotonic() - start, done


def _steps(run_dir: Path) -> int:
    return int(json.loads((run_dir / "summary.json").read_text())["steps"])


def faulty(
    args: Any,
    job_of: JobCommand,
    root: Path,
    mode: str,
    *,
    steps: int,
    clean_s: float,
    flags: list[str] | None = None,
) -> dict[str, Any]:
    """The same steps under the plan (``root``'s parent's ``plan.toml``), recovering by
    ``mode`` (``relaunch``; else live, from peer copies), with the launcher's
    ``flags`` (default: ``launch``'s restarts and ``--recovery mode``)."""
    work = root / mode
    plan = root.parent / "plan.toml"
    verdict = work / "verdict.json"
    work.mkdir()
    launch = [f"--max-restarts={args.max_restarts}", f"--recovery={mode}"]
    job = job_of(work, launch if flags is None else flags)
    job += [f"--save-every={args.save_every}", f"--steps={steps}", "--minutes=100000"]
    if mode != "relaunch":
        job.append(f"--copy-every={args.copy_every}")
    command = [SHARDWIRE, "chaos", str(plan), "--verdict", str(verdict), "--", *job]
    faulty_s, done = _run(command, timeout=max(3600.0, clean_s * 20))
    if not verdict.exists():
        raise BenchmarkFailed(f"the faulty job ({mode}) gave no verdict:\n{done.stderr[-3000:]}")
    outcome = json.loads(verdict.read_text())
    finished = outcome["exit_code"] == 0
    faults = [f for f in outcome["faults"] if f["injected"]]
    recovery = [f["recovery_s"] for f in faults if "recovery_s" in f]
    lost = [f["steps_lost"] for f in faults if "steps_lost" in f]
    return {
        "clean_s": round(clean_s, 2),
        "faulty_s": round(faulty_s, 2),
        "finished": finished,
        "goodput": round(clean_s / faulty_s, 3) if finished else 0.0,
        "faults": len(faults),
        "lost_per_fault_s": _seconds((faulty_s - clean_s) / len(faults)) if faults else None,
        "steps_lost": sum(lost),
        "recovery_s": recovery,
        "recovery_median_s": round(statistics.median(recovery), 2) if recovery else None,
        "recovery_max_s": round(max(recovery), 2) if recovery else None,
        "processes": outcome.get("processes"),
    }


def clean(args: Any, job_of: JobCommand, root: Path, name: str = "clean") -> tuple[float, int]:
    """The fault-free job for ``--minutes``: its wall time and the steps it made."""
    clean = root / name
    common = [f"--save-every={args.save_every}", "--steps=1000000"]
    command = job_of(clean, []) + common + [f"--minutes={args.minutes}"]
    clean_s, done = _run(command, timeout=args.minutes * 60 * 4 + 300)
    if done.returncode != 0:
        raise BenchmarkFailed(f"the fault-free job failed:\n{done.stderr[-3000:]}")
    return clean_s, _steps(clean / "run")


# The peers timed with --compare-torchft, in table order.
PEERS = ("torchft", "torchrun")
# A peer's run under the plan stops at this many times its fault-free run: its goodput
# is then below the inverse, which is all the table needs to say.
PEER_LIMIT = 4.0


def _peer(
    args: Any, peer: str, root: Path, *, steps: int, progress: Stages, pair: int
) -> dict[str, Any]:
    """``peer``'s fault-free run and its run under the plan's kills, for ``steps``."""
    flags = [*SHAPE, "--wrap=ddp", f"--steps={steps}"]
    schedule = [s for s in load(root.parent / "plan.toml").schedule(args.nproc) if s.at_s]

    def run(kind: str, plan: list, timeout: float) -> PeerRun:
        how = {"nproc": args.nproc, "work": root / f"{peer}-{kind}", "schedule": plan}
        how["timeout"] = timeout
        if peer == "torchft":
            return torchft_job(args.torchft_python, flags, **how)
        disk = [f"--save-every={args.save_every}"]
        return torchrun_job(example("torch_charlm.py"), flags + disk, **how)

    progress.start(f"pair {pair + 1}: {peer}, {steps} steps fault-free")
    clean = run("clean", [], max(3600.0, args.minutes * 60 * 20))
    if not clean.finished:
        raise BenchmarkFailed(f"{peer}'s fault-free job failed:\n{clean.detail}")
    progress.start(f"pair {pair + 1}: {peer}, {steps} steps under the plan")
    faulty = run("faulty", schedule, clean.wall_s * PEER_LIMIT)
    return {
        "clean_s": round(clean.wall_s, 2),
        "faulty_s": round(faulty.wall_s, 2),
        "finished": faulty.finished,
        # stopped at the limit: its goodput is below this
        "goodput": round(clean.wall_s / faulty.wall_s, 3),
        "faults": faulty.faults,
        "lost_per_fault_s": _seconds((faulty.wall_s - clean.wall_s) / faulty.faults)
        if faulty.faults
        else None,
        "steps_lost": None,
        "recovery_s": [],
        "recovery_median_s": None,
        "recovery_max_s": None,
        "processes": faulty.processes,
        "replicas_agree": faulty.agree,  # torchft's replicas' parameters at the end
    }


def summary(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's result over the pairs: the median pair's figures, with each pair's
    goodput and the median and range."""
    goodputs = [p["goodput"] for p in pairs]
    median = statistics.median(goodputs)
    middle = min(pairs, key=lambda p: abs(p["goodput"] - median))
    return {
        **middle,
        "goodput": round(median, 3),
        "goodput_range": [min(goodputs), max(goodputs)],
        "goodput_pairs": goodputs,
        "finished": all(p["finished"] for p in pairs),
    }


def plan_text(args: Any) -> str:
    """The fault plan: ``--kind`` on a random rank every ``--every`` s on average."""
    return (
        # no state notes: the fault-free run hashes nothing either
        f"seed = {args.seed}\ncheck_every = 0\n\n[[faults]]\nkind = {json.dumps(args.kind)}\n"
        f'rank = "random"\nevery_s = {args.every}\n'
        + ("for_s = 1.0\n" if args.kind in ("stop", "block") else "")
    )


def measure(args: Any) -> dict[str, Any]:
    job_of = launched(*_workload(args), args.nproc)
    modes = ["relaunch", "live"] if args.recovery == "both" else [args.recovery]
    peers = PEERS if args.compare_torchft else ()
    runs: list[dict[str, Any]] = []
    progress = Stages("goodput", args.pairs * (1 + len(modes) + 2 * len(peers)))
    with progress, tempfile.TemporaryDirectory(prefix="shardwire-goodput-") as scratch:
        (Path(scratch) / "plan.toml").write_text(plan_text(args))
        for pair in range(args.pairs):
            root = Path(scratch) / f"pair-{pair}"
            root.mkdir()
            progress.start(f"pair {pair + 1}: the fault-free job, {args.minutes:g} min")
            clean_s, steps = clean(args, job_of, root)
            outcomes = {}
            for mode in modes:
                progress.start(f"pair {pair + 1}: {steps} steps under the plan, {mode}")
                outcomes[mode] = faulty(args, job_of, root, mode, steps=steps, clean_s=clean_s)
            for peer in peers:
                outcomes[peer] = _peer(args, peer, root, steps=steps, progress=progress, pair=pair)
            runs.append({"clean_s": round(clean_s, 2), "steps": steps, "modes": outcomes})
    results = {m: summary([r["modes"][m] for r in runs]) for m in [*modes, *peers]}
    first = next(iter(results))  # relaunch when both ran: the mode run first
    headline = {k: results[first][k] for k in ("goodput", "steps_lost", "recovery_s")}
    return {
        "mode": first,
        **headline,  # the first mode's figures, at the top as well
        "workload": f"torch charlm ({args.torch})" if args.torch else "charlm",
        "nproc": args.nproc,
        "kind": args.kind,
        "every_s": args.every,
        "seed": args.seed,
        "steps": runs[0]["steps"],
        "save_every": args.save_every,
        "copy_every": args.copy_every,
        "clean_s": runs[0]["clean_s"],
        "pairs": runs,
        "modes": results,
    }


def table(r: dict[str, Any]) -> str:
    pairs = r.get("pairs", [])
    said = f"; {len(pairs)} pairs, goodput their median [range]" if len(pairs) > 1 else ""
    lines = [
        f"goodput: {r.get('workload', 'charlm')}, {r['nproc']} ranks, {r['steps']} steps, a "
        f"{r['kind']} of a random rank every {r['every_s']:g} s on average (seed "
        f"{r['seed']}){said}",
        f"  {'recovery':<9} {'fault-free (s)':>14} {'time (s)':>9} {'goodput':>8} {'faults':>7} "
        f"{'lost/fault (s)':>15} {'steps twice':>12} {'back after (s)':>15} {'processes':>10}",
    ]
    for mode, m in r["modes"].items():
        back = "-" if not m["recovery_s"] else f"{m['recovery_median_s']} / {m['recovery_max_s']}"
        twice = "-" if m["steps_lost"] is None else m["steps_lost"]
        fate = "" if m["finished"] else "  did NOT finish (restarts ran out?)"
        if mode in PEERS and not m["finished"]:
            fate = f"  stopped at {PEER_LIMIT:g}x its fault-free time: goodput below this"
        if len(pairs) > 1:
            low, high = m["goodput_range"]
            fate = f"  [{low:.3f}-{high:.3f}]{fate}"
        lines.append(
            f"  {mode:<9} {m['clean_s']:>14.1f} {m['faulty_s']:>9.1f} {m['goodput']:>8.3f} "
            f"{m['faults']:>7} {m['lost_per_fault_s']!s:>15} {twice:>12} {back:>15} "
            f"{m['processes']!s:>10}{fate}"
        )
    lines.append("  (back after: median / max seconds from a fault to training again)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench goodput``."""
    p = command_line("goodput", __doc__)
    p.add_argument("--nproc", type=int, default=4, help="local ranks of every job (%(default)s)")
    p.add_argument("--every", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument("--minutes", type=float, default=5.0, help="the fault-free job's length")
    p.add_argument(
        "--kind",
        default="kill",
        choices=["kill", "term", "stop", "raise", "block"],
        help="the fault: kill (SIGKILL), term (SIGTERM), stop (SIGSTOP for 1 s), raise "
        "(InjectedFault in the script), block (its event loop held 1 s) (%(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the plan's seed, which draws the faults' times and ranks (%(default)s)",
    )
    p.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument(
        "--recovery",
        default="both",
        choices=["relaunch", "live", "both"],
        help="how the faulty job recovers: relaunch from the checkpoint, live from the "
        "peers' copies, or each in turn (both)",
    )
    p.add_argument("--copy-every", type=int, default=5, help="steps between peer copies (live)")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=1000,
        help="the faulty jobs' launch --max-restarts: the failures they recover from, at "
        "most, before they end (%(default)s)",
    )
    p.add_argument(
        "--torch",
        choices=["ddp", "fsdp2"],
        help="train torch charlm over the shardwire backend, wrapped in DDP or FSDP2, "
        "instead of shardwire's own charlm",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="fault-free and faulty runs alternated this many times; each mode reports "
        "the median goodput and its range (%(default)s)",
    )
    p.add_argument(
        "--compare-torchft",
        action="store_true",
        help="with --torch ddp: also time torchft's DDP and torchrun --max-restarts over gloo "
        "on the same steps and kill schedule, each against its own fault-free run",
    )
    p.add_argument(
        "--torchft-python",
        help="the interpreter for --compare-torchft's replicas, with torchft and shardwire "
        "(default: this one, else ~/.cache/torchft-venv/bin/python)",
    )
    p.add_argument("--json", help="write the result here")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.compare_torchft:
        if args.torch != "ddp" or args.kind != "kill":
            print(
                "--compare-torchft times DDP under kills: give --torch ddp --kind kill",
                file=sys.stderr,
            )
            return 2
        args.torchft_python = torchft_python(args.torchft_python)
        if args.torchft_python is None:
            print(
                "--compare-torchft: no interpreter with torchft and shardwire (pip install "
                "torchft-nightly and this checkout; see --torchft-python)",
                file=sys.stderr,
            )
            return 2
    result = measure(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ours = [m for mode, m in result["modes"].items() if mode not in PEERS]
    return 0 if all(m["finished"] for m in ours) else 1


def _seconds(value: float) -> float:
    """Seconds to the hundredth; a run a few milliseconds faster than its fault-free one
    loses 0.0 s per fault, not -0.0."""
    return round(value, 2) + 0.0
