"""Goodput under failures: charlm on N local ranks with a seeded random fault every F
seconds, beside the same job without faults, in one invocation (run in a checkout).

    shardwire bench goodput [--nproc 4] [--every 30] [--minutes 5] [--json out.json]

The fault-free job trains for ``--minutes`` and sets the number of steps; the faulty one
trains the same steps under ``shardwire chaos`` with a plan that hits a random rank every
``--every`` seconds on average (SIGKILL by default, ``--kind``), and restarts from its
latest checkpoint each time (``--max-restarts``, ``--save-every``). Goodput is the
fault-free wall time over the faulty one for the same steps (1.0: the faults cost
nothing). Per fault, from the chaos verdict: how long until the job trained again
(recovery) and how many steps it computed twice (steps lost).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import example, parser

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
MODEL = ["--batch=16", "--context=32", "--dim=64", "--heads=4", "--layers=2", "--log-every=10"]


def _job(script: Path, nproc: int, work: Path, *args: str) -> list[str]:
    return [
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--run-id",
        f"goodput-{work.name}",
        *args,
        str(script),
        *MODEL,
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


def measure(args: Any) -> dict[str, Any]:
    script = example("charlm.py")
    with tempfile.TemporaryDirectory(prefix="shardwire-goodput-") as scratch:
        root = Path(scratch)
        clean, faulty = root / "clean", root / "faulty"
        common = [f"--save-every={args.save_every}", "--steps=1000000"]
        command = _job(script, args.nproc, clean) + common + [f"--minutes={args.minutes}"]
        clean_s, done = _run(command, timeout=args.minutes * 60 * 4 + 300)
        if done.returncode != 0:
            raise BenchmarkFailed(f"the fault-free job failed:\n{done.stderr[-3000:]}")
        steps = _steps(clean / "run")
        plan = root / "plan.toml"
        plan.write_text(
            f"seed = {args.seed}\n\n[[faults]]\nkind = {json.dumps(args.kind)}\n"
            f'rank = "random"\nevery_s = {args.every}\n'
            + ("for_s = 1.0\n" if args.kind in ("stop", "block") else "")
        )
        verdict = root / "verdict.json"
        restarts = [f"--max-restarts={args.max_restarts}"]
        job = _job(script, args.nproc, faulty, *restarts)
        job += [f"--save-every={args.save_every}", f"--steps={steps}", "--minutes=100000"]
        command = [SHARDWIRE, "chaos", str(plan), "--verdict", str(verdict), "--", *job]
        faulty_s, done = _run(command, timeout=max(3600.0, clean_s * 20))
        if not verdict.exists():
            raise BenchmarkFailed(f"the faulty job gave no verdict:\n{done.stderr[-3000:]}")
        outcome = json.loads(verdict.read_text())
        finished = outcome["exit_code"] == 0
    faults = [f for f in outcome["faults"] if f["injected"]]
    recovery = [f["recovery_s"] for f in faults if "recovery_s" in f]
    lost = [f["steps_lost"] for f in faults if "steps_lost" in f]
    return {
        "nproc": args.nproc,
        "kind": args.kind,
        "every_s": args.every,
        "seed": args.seed,
        "steps": steps,
        "clean_s": round(clean_s, 2),
        "faulty_s": round(faulty_s, 2),
        "finished": finished,
        "goodput": round(clean_s / faulty_s, 3) if finished else 0.0,
        "faults": len(faults),
        "steps_lost": sum(lost),
        "recovery_s": recovery,
        "recovery_median_s": round(statistics.median(recovery), 2) if recovery else None,
        "recovery_max_s": round(max(recovery), 2) if recovery else None,
    }


def table(r: dict[str, Any]) -> str:
    fate = "finished" if r["finished"] else "did NOT finish (restarts ran out?)"
    return "\n".join(
        [
            f"goodput: {r['nproc']} ranks, {r['steps']} steps, a {r['kind']} of a random rank "
            f"every {r['every_s']:g} s on average (seed {r['seed']})",
            f"  fault-free {r['clean_s']:.1f} s, with faults {r['faulty_s']:.1f} s: {fate}",
            f"  goodput {r['goodput']:.3f}; {r['faults']} faults, {r['steps_lost']} steps "
            f"computed twice; back to training after {r['recovery_median_s']} s "
            f"(median), {r['recovery_max_s']} s (max)",
        ]
    )


def main(argv: list[str]) -> int:
    p = parser("goodput", __doc__)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--every", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument("--minutes", type=float, default=5.0, help="the fault-free job's length")
    p.add_argument("--kind", default="kill", choices=["kill", "term", "stop", "raise", "block"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--max-restarts", type=int, default=1000)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    result = measure(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["finished"] else 1
