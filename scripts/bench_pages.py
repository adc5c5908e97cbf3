"""The performance page's collective figures, made from the benchmark run kept in
``docs/data/bench/collectives.json`` (its command, date, commit and machine beside the
rows ``shardwire bench collectives --json`` wrote): the table between the page's
``<!-- generated: collectives -->`` marks, and latency-vs-size plots beside it.
``docs_reference.py`` writes both and ``--check`` fails when either is stale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from diagrams import _svg
from slowlink_pages import kept_run, marks, size, source

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEPT = DOCS / "data" / "bench" / "collectives.json"
PAGE = DOCS / "guide" / "performance.md"
MARKS = marks("collectives")
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
SYSTEMS = {"": "shardwire", "mpi_": "Open MPI (shm)", "gloo_": "gloo"}


def _kept() -> dict[str, Any]:
    return kept_run(KEPT)


def table() -> str:
    """The markdown the page holds between its marks."""
    kept = _kept()
    rows = kept["rows"]
    sizes = sorted({r["bytes"] for r in rows})
    out = [
        source(kept) + " Ratio: the other's median time over shardwire's (above 1, "
        "shardwire is faster).",
        "",
        "| op | ranks | "
        + " | ".join(f"{size(s)} vs Open MPI" for s in sizes)
        + " | "
        + " | ".join(f"{size(s)} vs gloo" for s in sizes)
        + " |",
        "|---|---|" + "---|" * (2 * len(sizes)),
    ]
    for n in sorted({r["n"] for r in rows}):
        for op in OPS:
            cells = {r["bytes"]: r for r in rows if r["op"] == op and r["n"] == n}
            mpi = [f"{cells[s]['vs_mpi']:.2f}×" if s in cells else "" for s in sizes]
            gloo = [f"{cells[s]['vs_gloo']:.2f}×" if s in cells else "" for s in sizes]
            out.append(f"| {op} | {n} | " + " | ".join(mpi + gloo) + " |")
    out += _reads(rows, sizes)
    out += [
        "",
        "![Median latency against size per op and world size, shardwire beside Open "
        "MPI and gloo](../img/collectives-latency.svg)",
        "",
    ]
    return "\n".join(out)


def _reads(rows: list[dict], sizes: list[int]) -> list[str]:
    """all_gather as run (parts read from their owners' memory where the arena may) beside
    the same job with every part copied through the arena's region (``--compare-region``)."""
    gathers = [r for r in rows if r["op"] == "all_gather" and "vs_region" in r]
    if not gathers:
        return []
    out = [
        "",
        "all_gather as run, and with every part copied through the node arena's shared "
        "region instead (`--compare-region`, the same run): median µs, and the region's "
        "time over the run's.",
        "",
        "| ranks | " + " | ".join(size(s) for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for n in sorted({r["n"] for r in gathers}):
        cells = {r["bytes"]: r for r in gathers if r["n"] == n}
        shown = [
            f"{cells[s]['median_us']:.0f} / {cells[s]['region_median_us']:.0f} "
            f"({cells[s]['vs_region']:.2f}×)"
            if s in cells
            else ""
            for s in sizes
        ]
        out.append(f"| {n} | " + " | ".join(shown) + " |")
    return out


def page() -> str:
    """The performance page with its generated part brought up to date."""
    text = PAGE.read_text()
    if not MARKS.search(text):
        raise SystemExit(f"{PAGE} has no <!-- generated: collectives --> marks")
    return MARKS.sub(lambda m: m.group(1) + table() + "\n" + m.group(3), text)


def plot() -> str:
    """Latency against size, one panel per op, a line per system and world size."""
    rows = _kept()["rows"]
    worlds = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(1, len(OPS), figsize=(12, 3.2), sharey=True)
    for ax, op in zip(axes, OPS, strict=True):
        for n, style in zip(worlds, ["-", "--", ":"], strict=False):
            cells = sorted(
                (r for r in rows if r["op"] == op and r["n"] == n), key=lambda r: r["bytes"]
            )
            for prefix, name in SYSTEMS.items():
                key = f"{prefix}median_us"
                points = [(r["bytes"], r[key]) for r in cells if key in r]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, style, marker="o", markersize=3, label=f"{name}, {n} ranks")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("bytes")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("median µs")
    fig.tight_layout()
    return _svg(fig)
