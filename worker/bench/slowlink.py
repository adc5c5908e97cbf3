"""charlm across emulated hosts on slow links: plain data parallel, DiLoCo, and streaming
DiLoCo with int8 outer syncs, side by side at each link rate (root: the hosts are
network namespaces on a bridge, links shaped with tc tbf; one rank per host).

    shardwire bench slowlink [--hosts 2 4] [--rates 100mbit 1gbit unshaped] [--json out.json]

Two kinds of run. A link's rate changes how fast a mode trains, not what it computes
(every mode's losses are deterministic), so each mode trains once per host count on
unshaped links for ``--loss-steps`` steps: its held-out loss at the end (every mode sees
the same tokens) and along the way, the bytes that crossed a link per token (every byte
a rank sent: with one rank per host, all of them cross a link), and the largest outer
exchange (the peak a link must carry at once). Then each mode trains ``--steps`` steps
at each rate, for its tokens/s there; the modes alternate their order rate by rate.
``--plot`` draws held-out loss against tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench.hosts import emulated, rate_bits
from shardwire.worker.bench.jobs import command_line, example, run_nodes
from shardwire.worker.bench.stages import Stages

MODEL = {"batch": 32, "context": 64, "dim": 128, "heads": 4, "layers": 4, "lr": 3e-3, "seed": 0}
MODES = ("dp", "diloco", "streaming-int8")
RATES = ("100mbit", "1gbit", "unshaped")


def mode_flags(mode: str, replicas: int, args) -> list[str]:
    """charlm's flags for ``mode`` with one replica per host (DiLoCo's H, fragments and
    outer optimizer from ``args``)."""
    if mode == "dp":
        return []
    outer = ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    flags = ["--diloco", str(args.every), "--replicas", str(replicas), *outer]
    if mode == "streaming-int8":
        flags += ["--fragments", str(args.fragments), "--overlap", "--outer-quantize", "int8"]
    return flags


def _read(run_dir: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def run_mode(hosts, mode: str, args, tmp: Path, *, steps: int, log_every: int) -> dict:
    """charlm in ``mode`` for ``steps`` steps on ``hosts``: what its run says."""
    run_dir = tmp / f"{mode}-{hosts.count}-{hosts.rate or 'unshaped'}-{steps}"
    script = [
        str(example("charlm.py")),
        "--steps",
        str(steps),
        "--log-every",
        str(log_every),
        "--sample",
        "0",
        "--minutes",
        "600",
        "--run-dir",
        str(run_dir),
        *[f"--{k}={v}" for k, v in MODEL.items()],
        *mode_flags(mode, hosts.count, args),
    ]
    where = [(hosts.prefix(i), hosts.address(i)) for i in range(hosts.count)]
    run_nodes(script, hosts.count, hosts.count, dict(os.environ), hosts=where, timeout=7200)
    summary, records = _read(run_dir)
    tokens = summary["steps"] * MODEL["batch"] * MODEL["context"]
    return {
        "steps": summary["steps"],
        "tokens_per_s": summary["tokens_per_s"],
        "held_out_loss": summary["held_out_nats_per_char"],
        "cross_host_bytes_per_token": sum(records[-1]["bytes_sent"]) / tokens,
        "largest_exchange_bytes": summary.get("outer_largest_exchange_bytes"),
        "curve": [
            (r["step"] * MODEL["batch"] * MODEL["context"], r["held_out"])
            for r in records
            if "held_out" in r
        ],
    }


def stages(args) -> Stages:
    """The runs ahead, counted: every mode at every rate on every host count (``--steps``
    each), then every mode's loss run on every host count (``--loss-steps`` each)."""
    timed = len(args.hosts) * len(args.rates) * len(args.modes)
    losses = len(args.hosts) * len(args.modes)
    work = timed * args.steps + losses * args.loss_steps
    return Stages("slowlink", timed + losses, work=work)


def measure(args, tmp: Path) -> tuple[list[dict], list[dict]]:
    """The rows (a mode at a rate: tokens/s there, and the loss run's figures) and the
    loss runs' curves (a mode on a host count). Every timed run comes first, then the
    loss runs (which another load beside them would slow, not change)."""
    with stages(args) as progress:
        speed = _timed(args, tmp, progress)
        return _losses(args, tmp, progress, speed)


def _timed(args, tmp: Path, progress: Stages) -> dict[tuple[int, str, str], float]:
    """tokens/s of every mode at every rate on every host count, the modes' order
    turning rate by rate."""
    speed: dict[tuple[int, str, str], float] = {}
    turn = 0
    for count in args.hosts:
        for rate in args.rates:
            with emulated(count, None if rate == "unshaped" else rate) as hosts:
                for mode in args.modes[:: 1 if turn % 2 == 0 else -1]:
                    what = f"{count} hosts, {rate}, {mode}: {args.steps} steps timed"
                    progress.start(what, work=args.steps)
                    run = run_mode(hosts, mode, args, tmp, steps=args.steps, log_every=args.steps)
                    speed[count, mode, rate] = run["tokens_per_s"]
            turn += 1
    return speed


def _losses(
    args, tmp: Path, progress: Stages, speed: dict[tuple[int, str, str], float]
) -> tuple[list[dict], list[dict]]:
    """Every mode's loss run on every host count (unshaped: a rate changes how fast a mode
    trains, not what it computes), and the rows with ``speed``'s tokens/s beside them."""
    rows: list[dict] = []
    curves: list[dict] = []
    for count in args.hosts:
        with emulated(count, None) as hosts:
            for mode in args.modes:
                what = f"{count} hosts, {mode}: {args.loss_steps} steps for the loss"
                progress.start(what, work=args.loss_steps)
                run = run_mode(
                    hosts, mode, args, tmp, steps=args.loss_steps, log_every=args.log_every
                )
                curves.append({"hosts": count, "mode": mode, "curve": run["curve"]})
                rows += [
                    {
                        "mode": mode,
                        "hosts": count,
                        "rate": rate,
                        "steps": args.steps,
                        "tokens_per_s": speed[count, mode, rate],
                        "loss_steps": run["steps"],
                        "held_out_loss": run["held_out_loss"],
                        "cross_host_bytes_per_token": run["cross_host_bytes_per_token"],
                        "largest_exchange_bytes": run["largest_exchange_bytes"],
                    }
                    for rate in args.rates
                ]
    return rows, curves


def print_table(rows: list[dict]) -> None:
    print(
        "| hosts | rate | mode | tokens/s | held-out loss | cross-host bytes/token "
        "| largest exchange |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = r["largest_exchange_bytes"]
        print(
            f"| {r['hosts']} | {r['rate']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
            f"{r['held_out_loss']:.4f} | {r['cross_host_bytes_per_token']:,.1f} | "
            f"{'-' if peak is None else f'{peak / 2**20:.2f} MiB'} |"
        )
    if rows:
        print(
            f"tokens/s over {rows[0]['steps']} steps at each rate; the loss, bytes and "
            f"exchange of {rows[0]['loss_steps']} steps, unshaped (rates do not change them)"
        )
    print("tc tbf shapes the rate only (no netem here): no added delay or loss")


def figure(curves: list[dict]):
    """Held-out loss against tokens: a panel per host count, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({c["hosts"] for c in curves})
    fig, axes = plt.subplots(1, len(counts), figsize=(4.2 * len(counts), 3.4), squeeze=False)
    for ax, count in zip(axes[0], counts, strict=True):
        for c in curves:
            if c["hosts"] == count and c["curve"]:
                tokens, loss = zip(*c["curve"], strict=True)
                ax.plot(tokens, loss, marker="o", markersize=3, label=c["mode"])
        ax.set_title(f"{count} hosts (any link rate)", fontsize=9)
        ax.set_xlabel("tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out loss (nats/char)")
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench slowlink``."""
    p = command_line("slowlink", __doc__)
    p.add_argument(
        "--hosts",
        type=int,
        nargs="+",
        default=[2, 4],
        help="emulated hosts of a job, one rank each; every run is made per value (2 4)",
    )
    p.add_argument(
        "--rates",
        nargs="+",
        default=list(RATES),
        help="the link rates of the timed runs (tc tbf: 100mbit, 1gbit, ...), or unshaped "
        f"({' '.join(RATES)})",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="dp: plain data parallel; diloco: DiLoCo, outer syncs every --every steps; "
        "streaming-int8: streaming DiLoCo, --fragments fragments, int8 outer syncs (all three)",
    )
    p.add_argument("--steps", type=int, default=200, help="steps per run timed at a rate")
    p.add_argument("--loss-steps", type=int, default=3000, help="steps of each loss run")
    p.add_argument("--log-every", type=int, default=250, help="held-out loss every N steps")
    p.add_argument("--every", type=int, default=100, help="DiLoCo's H: steps between syncs")
    p.add_argument("--fragments", type=int, default=4, help="streaming fragments")
    p.add_argument("--outer-lr", type=float, default=1.0, help="DiLoCo's outer rate")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="its Nesterov momentum")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="draw held-out loss against tokens here (PNG or SVG)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for rate in args.rates:
        if rate != "unshaped":
            rate_bits(rate)
    with tempfile.TemporaryDirectory(prefix="shardwire-slowlink-") as directory:
        rows, curves = measure(args, Path(directory))
    rows.sort(
        key=lambda r: (
            r["hosts"],
            RATES.index(r["rate"]) if r["rate"] in RATES else 9,
            MODES.index(r["mode"]),
        )
    )
    print_table(rows)
    if args.json:
        settings = {
            "model": MODEL,
            "every": args.every,
            "fragments": args.fragments,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "steps": args.steps,
            "loss_steps": args.loss_steps,
        }
        Path(args.json).write_text(
            json.dumps({**settings, "rows": rows, "curves": curves}, indent=2)
        )
    if args.plot:
        figure(curves).savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
