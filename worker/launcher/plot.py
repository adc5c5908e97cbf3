"""``shardwire plot RUN_DIR``: loss (and accuracy, when logged) and throughput curves from
a run directory's metrics.jsonl, and, where the records carry them, each rank's time per
step split into computing and waiting for communication (stacked bars), as a PNG. Needs
matplotlib (the ``examples`` extra)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardwire.protocol.errors import InvalidArgument

WIDTH_IN, HEIGHT_IN, DPI = 10, 4, 100  # a 1000 x 400 pixel image


def load(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise InvalidArgument(f"{path} does not exist; is {run_dir} a run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: Path, out: Path) -> Path:
    """Draw ``run_dir``'s curves into ``out`` (PNG, or SVG by its suffix: a deterministic
    file, for documentation kept in a repository)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "shardwire plot needs matplotlib: pip install 'shardwire[examples]'"
        ) from None
    fig = figure(load(run_dir), run_dir.name)
    if out.suffix == ".svg":
        with plt.rc_context({"svg.hashsalt": "shardwire", "svg.fonttype": "path"}):
            fig.savefig(out, dpi=DPI, metadata={"Date": None})
    else:
        fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def figure(records: list[dict], title: str):
    """The panels: loss (with held-out loss and accuracy where logged), throughput from
    zero, and where the records carry it the time per step by rank; a legend on each."""
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    split = [r for r in records if "comm_s" in r and "compute_s" in r]
    fig, axes = plt.subplots(1, 3 if split else 2, figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    left, right = axes[0], axes[1]
    lines = left.plot(steps, [r["loss"] for r in records], label="loss", color="tab:blue")
    held = [(r["step"], r["held_out"]) for r in records if r.get("held_out") is not None]
    if held:
        lines += left.plot(*zip(*held, strict=True), label="held-out loss", color="tab:purple")
    left.set_xlabel("step")
    left.set_ylabel("loss")
    top = left  # the legend goes on the top axes, or a twin's curve hides it
    if any("accuracy" in r for r in records):
        acc = top = left.twinx()
        lines += acc.plot(
            steps, [r.get("accuracy") for r in records], color="tab:green", label="accuracy"
        )
        acc.set_ylabel("accuracy")
    top.legend(lines, [line.get_label() for line in lines], fontsize="small", loc="center right")
    left.set_title("loss")
    right.plot(steps, [r["samples_per_s"] for r in records], color="tab:orange", label="samples/s")
    right.set_ylim(bottom=0)  # heights are compared: from zero
    right.set_xlabel("step")
    right.set_ylabel("samples / s")
    right.set_title("throughput")
    right.legend(fontsize="small", loc="lower right")
    if split:
        _breakdown(axes[2], split)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _breakdown(ax, records: list[dict]) -> None:
    """Mean seconds per step by rank: computing (below) and waiting for collectives."""
    ranks = range(len(records[0]["comm_s"]))
    compute = [sum(r["compute_s"][i] for r in records) / len(records) for i in ranks]
    comm = [sum(r["comm_s"][i] for r in records) / len(records) for i in ranks]
    ax.bar(ranks, compute, color="tab:blue", label="compute")
    ax.bar(ranks, comm, bottom=compute, color="tab:red", label="waiting for comm")
    ax.set_xlabel("rank")
    ax.set_ylabel("s / step")
    ax.set_xticks(list(ranks))
    ax.set_title("time per step")
    ax.legend(fontsize="small")


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire plot``."""
    p = argparse.ArgumentParser(
        prog="shardwire plot",
        description=__doc__,
        epilog="example:\n  shardwire plot runs/digits --out loss.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "run_dir",
        type=Path,
        help="a run directory: where the run log wrote metrics.jsonl (an example's --run-dir)",
    )
    p.add_argument("--out", type=Path, help="PNG path (default RUN_DIR/metrics.png)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        out = plot(args.run_dir, args.out or args.run_dir / "metrics.png")
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"shardwire plot: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
