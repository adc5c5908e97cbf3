"""charlm across emulated hosts on slow links: plain data parallel, DiLoCo, and streaming
DiLoCo with int8 outer syncs, side by side at each link rate (root: the hosts are
network namespaces on a bridge, links shaped with tc tbf; one rank per host).

    shardwire bench slowlink [--hosts 2 4] [--rates 100mbit 1gbit unshaped] [--json out.json]

Per mode and rate: tokens/s, held-out loss at the end (every mode sees the same tokens),
cross-host bytes per token (every byte a rank sent: with one rank per host, all of them
cross a link), and the largest outer exchange (the peak a link must carry at once). The
modes alternate their order rate by rate. ``--plot`` draws held-out loss against tokens.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench.hosts import emulated, rate_bits
from shardwire.worker.bench.jobs import example, parser, run_nodes

MODEL = {"batch": 32, "context": 64, "dim": 128, "heads": 4, "layers": 4, "lr": 3e-3, "seed": 0}
MODES = ("dp", "diloco", "streaming-int8")
RATES = ("100mbit", "1gbit", "unshaped")


def mode_flags(mode: str, replicas: int, every: int, fragments: int) -> list[str]:
    """charlm's flags for ``mode`` with one replica per host."""
    if mode == "dp":
        return []
    flags = ["--diloco", str(every), "--replicas", str(replicas)]
    if mode == "streaming-int8":
        flags += ["--fragments", str(fragments), "--overlap", "--outer-quantize", "int8"]
    return flags


def _read(run_dir: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def run_mode(hosts, mode: str, args, tmp: Path) -> dict:
    run_dir = tmp / f"{mode}-{hosts.count}-{hosts.rate or 'unshaped'}"
    script = [str(example("charlm.py")), "--steps", str(args.steps),
              "--log-every", str(args.log_every), "--sample", "0", "--minutes", "600",
              "--run-dir", str(run_dir), *[f"--{k}={v}" for k, v in MODEL.items()],
              *mode_flags(mode, hosts.count, args.every, args.fragments)]  # fmt: skip
    where = [(hosts.prefix(i), hosts.address(i)) for i in range(hosts.count)]
    run_nodes(script, hosts.count, hosts.count, dict(os.environ), hosts=where, timeout=3600)
    summary, records = _read(run_dir)
    tokens = summary["steps"] * MODEL["batch"] * MODEL["context"]
    sent = sum(records[-1]["bytes_sent"])
    return {
        "mode": mode,
        "hosts": hosts.count,
        "rate": hosts.rate or "unshaped",
        "steps": summary["steps"],
        "tokens_per_s": summary["tokens_per_s"],
        "held_out_loss": summary["held_out_nats_per_char"],
        "cross_host_bytes_per_token": sent / tokens,
        "largest_exchange_bytes": summary.get("outer_largest_exchange_bytes"),
        "curve": [
            (r["step"] * MODEL["batch"] * MODEL["context"], r["held_out"])
            for r in records
            if "held_out" in r
        ],
    }


def print_table(rows: list[dict]) -> None:
    print(
        "| hosts | rate | mode | tokens/s | held-out loss | cross-host bytes/token "
        "| largest exchange |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = r["largest_exchange_bytes"]
        print(f"| {r['hosts']} | {r['rate']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
              f"{r['held_out_loss']:.4f} | {r['cross_host_bytes_per_token']:,.1f} | "
              f"{'-' if peak is None else f'{peak / 2**20:.2f} MiB'} |")  # fmt: skip
    print("tc tbf shapes the rate only (no netem here): no added delay or loss")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["hosts"], r["rate"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.4), squeeze=False)
    for ax, (count, rate) in zip(axes[0], groups, strict=True):
        for r in rows:
            if (r["hosts"], r["rate"]) == (count, rate) and r["curve"]:
                tokens, loss = zip(*r["curve"], strict=True)
                ax.plot(tokens, loss, marker="o", markersize=3, label=r["mode"])
        ax.set_title(f"{count} hosts, {rate}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("held-out loss (nats/char)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = parser("slowlink", __doc__)
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", nargs="+", default=list(RATES))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--every", type=int, default=50, help="DiLoCo's H: steps between syncs")
    p.add_argument("--fragments", type=int, default=4, help="streaming fragments")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--plot", help="draw held-out loss against tokens here (PNG or SVG)")
    args = p.parse_args(argv)
    for rate in args.rates:
        if rate != "unshaped":
            rate_bits(rate)
    rows: list[dict] = []
    turn = 0
    with tempfile.TemporaryDirectory(prefix="shardwire-slowlink-") as directory:
        for count in args.hosts:
            for rate in args.rates:
                with emulated(count, None if rate == "unshaped" else rate) as hosts:
                    for mode in args.modes[:: 1 if turn % 2 == 0 else -1]:
                        rows.append(run_mode(hosts, mode, args, Path(directory)))
                        print(f"[bench]: {count} hosts, {rate}, {mode} done", file=sys.stderr,
                              flush=True)  # fmt: skip
                turn += 1
    rows.sort(key=lambda r: (r["hosts"], RATES.index(r["rate"]) if r["rate"] in RATES else 9,
                             MODES.index(r["mode"])))  # fmt: skip
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": MODEL, "every": args.every,
                                               "fragments": args.fragments, "rows": rows},
                                              indent=2))  # fmt: skip
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
