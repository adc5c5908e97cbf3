"""Jobs on a Ray cluster this machine starts (a head and one worker node, on loopback),
beside their baselines in the same invocation (run in a checkout, with Ray Train and torch).

    shardwire bench ray --pairs 3 --minutes 1
    shardwire bench ray --skip-goodput --json ray.json

Two parts, each alternating the systems it compares, pair by pair (this machine is noisy):

- **throughput**: torch charlm (``examples/torch_charlm.py``, DDP, ``--nproc`` workers)
  trained by Ray Train's torch trainer for ``--minutes``, over shardwire
  (``ShardwireConfig``) and over gloo; tokens/s as the training loop measures it (the
  trainer's start left out), and their ratio per pair.
- **goodput**: shardwire's numpy charlm on ``--nproc`` ranks with a seeded SIGKILL of a
  random rank every ``--every`` seconds on average, run by ``shardwire ray`` (each rank an
  actor; Ray starts a killed one again and it joins live) and by ``shardwire launch
  --recovery live``; each against its own fault-free run of ``--goodput-minutes``, the
  same steps, peer copies every ``--copy-every`` steps. Goodput is the fault-free time
  over the faulty one.

A line per stage on standard error says what runs and about how long is left.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from shardwire.ray.localcluster import LOOPBACK, start
from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.goodput import (
    SHAPE,
    JobCommand,
    clean,
    dirs,
    faulty,
    launched,
    plan_text,
    summary,
)
from shardwire.worker.bench.jobs import command_line, example
from shardwire.worker.bench.stages import Stages

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
BACKENDS = ("shardwire", "gloo")


def on_ray(address: str, script: Path, model: list[str], nproc: int) -> JobCommand:
    """``shardwire ray`` of ``nproc`` ranks, all on one node as ``launch`` puts them."""

    def command(work: Path, flags: list[str]) -> list[str]:
        head = [SHARDWIRE, "ray", "--address", address, "--num-workers", str(nproc)]
        head += ["--workers-per-node", str(nproc), "--run-id", f"goodput-{work.name}"]
        return [*head, *flags, *dirs(script, model, work)]

    return command


def _charlm(address: str, backend: str, args: Any) -> dict[str, Any]:
    flags = [*SHAPE, "--wrap=ddp", "--steps=1000000", f"--minutes={args.minutes}"]
    command = [sys.executable, "-m", "shardwire.ray.charlm", address, backend, str(args.nproc)]
    done = subprocess.run(  # noqa: S603 - our own module
        [*command, *flags],
        capture_output=True,
        text=True,
        timeout=args.minutes * 60 * 4 + 600,
        check=False,
    )
    if done.returncode != 0:
        raise BenchmarkFailed(
            f"charlm under Ray Train over {backend} failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(address: str, args: Any, progress: Stages) -> dict[str, Any]:
    pairs: list[dict[str, Any]] = []
    ratios: list[float] = []
    for pair in range(args.pairs):
        order = BACKENDS if pair % 2 == 0 else BACKENDS[::-1]
        runs = {}
        for backend in order:
            progress.start(f"pair {pair + 1}: Ray Train over {backend}, {args.minutes:g} min")
            runs[backend] = _charlm(address, backend, args)
        ours, theirs = (runs[b]["tokens_per_s"] for b in BACKENDS)
        ratios.append(round(ours / theirs, 3))
        pairs.append({"tokens_per_s": {b: runs[b]["tokens_per_s"] for b in BACKENDS}})
        pairs[-1]["ratio"] = ratios[-1]
    return {
        "workload": f"torch charlm (DDP), {args.nproc} Ray Train workers",
        "pairs": pairs,
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [min(ratios), max(ratios)],
    }


def goodput(address: str, args: Any, progress: Stages) -> dict[str, Any]:
    script = example("charlm.py")
    model = [*SHAPE, "--log-every=10"]
    jobs = {
        "ray": on_ray(address, script, model, args.nproc),
        "launch": launched(script, model, args.nproc),
    }
    flags = {"ray": [f"--max-restarts={args.max_restarts}"], "launch": None}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    with tempfile.TemporaryDirectory(prefix="shardwire-ray-goodput-") as scratch:
        (Path(scratch) / "plan.toml").write_text(plan_text(args))
        for pair in range(args.pairs):
            order = list(jobs) if pair % 2 == 0 else list(jobs)[::-1]
            for name in order:
                root = Path(scratch) / f"pair-{pair}-{name}"
                root.mkdir()
                progress.start(f"pair {pair + 1}: {name}, fault-free, {args.minutes:g} min")
                clean_s, steps = clean(args, jobs[name], root)
                progress.start(f"pair {pair + 1}: {name}, {steps} steps under the plan")
                run = faulty(
                    args, jobs[name], root, "live", steps=steps, clean_s=clean_s, flags=flags[name]
                )
                runs[name].append({**run, "steps": steps})
    modes = {name: summary(found) for name, found in runs.items()}
    return {
        "workload": f"charlm, {args.nproc} ranks, live recovery, copies every {args.copy_every}",
        "every_s": args.every,
        "seed": args.seed,
        "modes": modes,
        "difference": round(modes["ray"]["goodput"] - modes["launch"]["goodput"], 3),
    }


def table(result: dict[str, Any]) -> str:
    lines = []
    if "throughput" in result:
        t = result["throughput"]
        lines.append(f"throughput: {t['workload']}, tokens/s, {len(t['pairs'])} pair(s)")
        lines.append(f"  {'pair':<5} {'shardwire':>10} {'gloo':>10} {'ratio':>7}")
        for i, p in enumerate(t["pairs"]):
            s, g = (p["tokens_per_s"][b] for b in BACKENDS)
            lines.append(f"  {i + 1:<5} {s:>10,} {g:>10,} {p['ratio']:>7.3f}")
        low, high = t["ratio_range"]
        lines.append(f"  median ratio {t['ratio']:.3f} [{low:.3f}-{high:.3f}]")
    if "goodput" in result:
        g = result["goodput"]
        lines.append(
            f"goodput: {g['workload']}; a SIGKILL of a random rank every {g['every_s']:g} s "
            f"(seed {g['seed']})"
        )
        lines.append(
            f"  {'run by':<7} {'fault-free (s)':>14} {'time (s)':>9} {'goodput':>8} "
            f"{'faults':>7} {'lost/fault (s)':>15} {'processes':>10}"
        )
        for name, m in g["modes"].items():
            low, high = m["goodput_range"]
            fate = "" if m["finished"] else "  did NOT finish"
            lines.append(
                f"  {name:<7} {m['clean_s']:>14.1f} {m['faulty_s']:>9.1f} {m['goodput']:>8.3f} "
                f"{m['faults']:>7} {m['lost_per_fault_s']!s:>15} {m['processes']!s:>10}"
                f"  [{low:.3f}-{high:.3f}]{fate}"
            )
        lines.append(f"  ray minus launch: {g['difference']:+.3f}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = command_line("ray", __doc__)
    p.add_argument("--nproc", type=int, default=4, help="ranks of every job (%(default)s)")
    p.add_argument("--pairs", type=int, default=2, help="alternations of each part")
    p.add_argument("--minutes", type=float, default=1.0, help="each timed run's length")
    p.add_argument(
        "--goodput-minutes", type=float, default=2.0, help="each fault-free goodput run's length"
    )
    p.add_argument("--every", type=float, default=20.0, help="mean seconds between kills")
    p.add_argument("--seed", type=int, default=0, help="the kill plan's seed")
    p.add_argument("--copy-every", type=int, default=5, help="steps between peer copies")
    p.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints")
    p.add_argument("--max-restarts", type=int, default=1000, help="the faulty jobs' budget")
    p.add_argument("--skip-throughput", action="store_true", help="time goodput only")
    p.add_argument("--skip-goodput", action="store_true", help="time throughput only")
    p.add_argument("--json", help="write the result here")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.kind = "kill"
    # every driver this starts (shardwire ray, Ray Train's) reaches the loopback cluster
    os.environ.update(LOOPBACK)
    parts = int(not args.skip_throughput) * 2 + int(not args.skip_goodput) * 4
    result: dict[str, Any] = {"nproc": args.nproc}
    with Stages("ray", args.pairs * parts + 1) as progress:
        progress.start(f"a local Ray cluster: one node of {args.nproc} CPUs")
        with start(1, args.nproc) as address:
            if not args.skip_throughput:
                result["throughput"] = throughput(address, args, progress)
            if not args.skip_goodput:
                timed = argparse.Namespace(**{**vars(args), "minutes": args.goodput_minutes})
                result["goodput"] = goodput(address, timed, progress)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
