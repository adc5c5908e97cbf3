"""Gradient aggregation and compression on the digits example, in one run: top-k 1 %
with error feedback against uncompressed all-reduce (gradient bytes each rank sends,
steps to 95 % held-out accuracy), and the parameter server against ring all-reduce
(step time) at 2 and 4 ranks.

    shardwire bench aggregation [--steps 1200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench.jobs import command_line, example
from shardwire.worker.bench.stages import Stages


def digits(nproc: int, *flags: str, steps: int, log_every: int) -> tuple[dict, list[dict]]:
    """Run examples/digits.py; return its summary and metric records."""
    shardwire = str(Path(sys.executable).parent / "shardwire")
    with tempfile.TemporaryDirectory(prefix="shardwire-agg-bench-") as tmp:
        subprocess.run(
            [
                shardwire,
                "launch",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                str(example("digits.py")),
                *flags,
                "--steps",
                str(steps),
                "--log-every",
                str(log_every),
                "--run-dir",
                tmp,
            ],
            check=True,
            timeout=3600,
            stdout=subprocess.DEVNULL,
        )
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        return summary, [json.loads(line) for line in lines]


def steps_to(records: list[dict], target: float) -> int | None:
    return next((r["step"] for r in records if r.get("accuracy", 0) >= target), None)


def table(rows: list[dict]) -> str:
    """The rows as two markdown tables: top-k against uncompressed gradients, then the
    parameter server's step against the ring all-reduce's."""
    codecs = [r for r in rows if "compress" in r]
    steps = [r for r in rows if "n" in r]
    out = [
        "| ranks | gradients | grad MiB sent per rank | fewer bytes | steps to 95 % | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    base = codecs[0]["summary"]["grad_MiB_sent_per_rank"][0]
    for r in codecs:
        sent = r["summary"]["grad_MiB_sent_per_rank"][0]
        out.append(
            f"| 2 | {r['compress']} | {sent:.2f} | {base / sent:.0f}x | {r['to95']} | "
            f"{r['summary']['held_out_accuracy']:.4f} |"
        )
    out += ["", "| ranks | parameter server step (ms) | ring all-reduce step (ms) |"]
    out += ["|---|---|---|"]
    out += [f"| {r['n']} | {r['ps_ms']:.2f} | {r['ring_ms']:.2f} |" for r in steps]
    return "\n".join(out)


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench aggregation``."""
    p = command_line("aggregation", __doc__)
    p.add_argument(
        "--steps",
        type=int,
        default=1200,
        help="steps of each compression run, for the steps to 95 %% accuracy (the parameter "
        "server and ring runs take 200) (%(default)s)",
    )
    p.add_argument("--json", help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    rows: list[dict] = []
    # two runs of --steps, then four of 200 steps: the work is their steps
    with Stages("aggregation", 6, work=2 * args.steps + 4 * 200) as progress:
        for compress in ("none", "topk:0.01"):
            progress.start(f"2 ranks, gradients {compress}: {args.steps} steps", work=args.steps)
            summary, records = digits(
                2,
                "--aggregator",
                "allreduce",
                "--compress",
                compress,
                steps=args.steps,
                log_every=10,
            )
            rows.append({"compress": compress, "summary": summary, "to95": steps_to(records, 0.95)})
        for n in (2, 4):
            progress.start(f"{n} ranks, parameter server: 200 steps timed", work=200)
            ps, _ = digits(n, "--aggregator", "ps", steps=200, log_every=100)
            progress.start(f"{n} ranks, ring all-reduce: 200 steps timed", work=200)
            ring, _ = digits(n, "--aggregator", "allreduce", steps=200, log_every=100)
            rows.append({"n": n, "ps_ms": ps["step_ms"], "ring_ms": ring["step_ms"]})
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
