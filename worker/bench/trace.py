"""What a timeline costs: tokens/s of ``examples/charlm.py`` (FULL_SHARD with prefetch:
every collective, FSDP phase and the script's spans are recorded) with
``shardwire launch --trace`` and without, at 2 and 4 ranks, in one run.

    shardwire bench trace [--world 2 4] [--steps 60] [--repeats 3] [--json out.json]

The two alternate run by run (the order turns around every repeat), so a machine that
slows down during the run hurts both alike. The overhead is the median without over the
median with, minus one; the events each traced rank recorded are counted too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench.jobs import command_line, example
from shardwire.worker.bench.stages import Stages
from shardwire.worker.bench.torchrun import clean_env

SHARDWIRE = str(Path(sys.executable).parent / "shardwire")
MODEL = ["--batch=32", "--context=64", "--dim=128", "--heads=4", "--layers=4", "--seed=0"]


def run(n: int, steps: int, traced: bool, tmp: Path) -> tuple[float, int]:
    """(tokens/s, events per rank) of one run."""
    tag = f"{n}-{'on' if traced else 'off'}-{len(list(tmp.iterdir()))}"
    flags = ["--trace", "--trace-dir", str(tmp / f"{tag}-trace")] if traced else []
    cmd = [
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(n),
        *flags,
        str(example("charlm.py")),
        "--steps",
        str(steps),
        "--log-every",
        str(10 * steps),
        "--sample",
        "0",
        "--run-dir",
        str(tmp / tag),
        *MODEL,
    ]
    subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL, env=clean_env())
    rate = float(json.loads((tmp / tag / "summary.json").read_text())["tokens_per_s"])
    events = 0
    if traced:
        rank0 = json.loads((tmp / f"{tag}-trace" / "rank-0.json").read_text())
        events = sum(e["ph"] in {"X", "b"} for e in rank0["traceEvents"])
    return rate, events


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench trace``."""
    p = command_line("trace", __doc__)
    p.add_argument(
        "--world", type=int, nargs="+", default=[2, 4], help="ranks of a run, a row per value (2 4)"
    )
    p.add_argument(
        "--steps", type=int, default=60, help="training steps of every run (%(default)s)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs traced and untraced each at every world size, alternating, the order "
        "turned around every repeat (%(default)s)",
    )
    p.add_argument("--json", help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = []
    progress = Stages("trace", len(args.world) * args.repeats * 2)
    with progress, tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n in args.world:
            rates: dict[bool, list[float]] = {False: [], True: []}
            events = 0
            for repeat in range(args.repeats):
                for traced in (False, True) if repeat % 2 == 0 else (True, False):
                    said = "traced" if traced else "untraced"
                    progress.start(f"{n} ranks, run {repeat + 1}/{args.repeats}: {said}")
                    rate, seen = run(n, args.steps, traced, tmp)
                    rates[traced].append(rate)
                    events = max(events, seen)
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            rows.append(
                {
                    "ranks": n,
                    "untraced_tokens_per_s": rates[False],
                    "traced_tokens_per_s": rates[True],
                    "overhead_percent": round((off / on - 1) * 100, 2),
                    "events_per_rank": events,
                }
            )
    print(f"{'ranks':>5}  {'untraced tok/s':>24}  {'traced tok/s':>24}  {'overhead':>8}  events")
    for r in rows:
        plain = ", ".join(f"{v:,.0f}" for v in r["untraced_tokens_per_s"])
        timed = ", ".join(f"{v:,.0f}" for v in r["traced_tokens_per_s"])
        print(
            f"{r['ranks']:>5}  {plain:>24}  {timed:>24}  {r['overhead_percent']:>7.1f}%  "
            f"{r['events_per_rank']:,}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
