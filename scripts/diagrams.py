"""The documentation's figures, drawn from this source with matplotlib (no hand-drawn
binaries): ``docs/img/architecture.svg``, a job of two nodes of two ranks each, and
``docs/img/digits-metrics.svg``, ``shardwire plot`` of the main job's run directory kept
in ``docs/data`` (a real run's files).

``scripts/docs_reference.py`` writes them with the reference pages and ``--check`` holds
the committed files to what this draws (the SVG is deterministic: fixed hash salt, no
date, text as paths)."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

CONTROL = "#555555"
LANE = ("#1f77b4", "#d62728")
ARENA = "#2ca02c"


def _box(ax, rect, text, *, face="white", edge="black", size=9, weight="normal"):
    x, y, w, h = rect
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=face,
            edgecolor=edge,
            linewidth=1.2,
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def _arrow(ax, start, end, *, color, style="-", both=False, width=1.2):
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="<|-|>" if both else "-|>",
            mutation_scale=10,
            color=color,
            linestyle=style,
            linewidth=width,
        )
    )


def architecture() -> str:
    """A coordinator, two nodes (each a node agent and two worker processes sharing a node
    arena), the control connections and the lanes between the nodes, as SVG text."""
    return _svg(draw_architecture())


def _svg(fig: plt.Figure) -> str:
    """``fig`` as SVG text that is the same on every run (no date, fixed ids)."""
    plt.rcParams["svg.hashsalt"] = "shardwire"
    plt.rcParams["svg.fonttype"] = "path"
    out = io.StringIO()
    fig.savefig(out, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    return out.getvalue()


def draw_architecture() -> plt.Figure:
    """The architecture figure (see :func:`architecture`)."""
    fig, ax = plt.subplots(figsize=(9, 5.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    _box(
        ax,
        (2.4, 5.3, 5.2, 0.8),
        "coordinator\nrendezvous · ranks · liveness · generations",
        face="#f3f3f3",
        weight="bold",
    )
    ranks = {}
    for node, x0 in ((0, 0.3), (1, 5.3)):
        ax.add_patch(
            FancyBboxPatch(
                (x0, 0.3),
                4.4,
                4.3,
                boxstyle="round,pad=0.02,rounding_size=0.12",
                facecolor="#fbfbfb",
                edgecolor="#999999",
                linestyle="--",
            )
        )
        ax.text(
            x0 + 0.15,
            4.4,
            f"node rank {node} (a host: node id host-{'ab'[node]})",
            fontsize=9,
            weight="bold",
            va="top",
        )
        _box(ax, (x0 + 0.9, 3.35, 2.6, 0.6), "node agent\nstarts and watches its ranks", size=8)
        _arrow(ax, (x0 + 2.2, 3.95), (5.0, 5.3), color=CONTROL)
        for local in (0, 1):
            rank = node * 2 + local
            slot = local if node == 0 else 1 - local  # mirrored: lane 1 meets in the middle
            x = x0 + 0.3 + slot * 2.1
            _box(
                ax, (x, 1.75, 1.7, 0.9), f"rank {rank}\nlocal rank {local}\nworker process", size=8
            )
            _arrow(ax, (x0 + 2.2, 3.35), (x + 0.85, 2.65), color=CONTROL, style=":")
            ranks[rank] = (x + 0.85, 1.75)
        arena = "node arena: one shared-memory region\n(collectives among this node's ranks)"
        _box(ax, (x0 + 0.3, 0.55, 3.8, 0.6), arena, face="#e8f5e9", edge=ARENA, size=8)
        for local in (0, 1):
            x, y = ranks[node * 2 + local]
            _arrow(ax, (x, y), (x, 1.15), color=ARENA, both=True)
    (xa, top), (xb, _) = ranks[0], ranks[2]
    top += 0.9
    ax.plot([xa, xa, xb, xb], [top, 3.1, 3.1, top], color=LANE[0], linewidth=1.6)
    (xa, _), (xb, _) = ranks[1], ranks[3]
    _arrow(ax, (xa + 0.85, 2.2), (xb - 0.85, 2.2), color=LANE[1], both=True, width=1.6)
    ax.text(5.0, 3.17, "lane 0 (TCP)", ha="center", fontsize=7, color=LANE[0])
    ax.text(5.0, 2.28, "lane 1", ha="center", fontsize=7, color=LANE[1])
    handles = [
        plt.Line2D([], [], color=CONTROL, label="control: join, heartbeats (batched per node)"),
        plt.Line2D([], [], color=CONTROL, linestyle=":", label="agent starts its ranks"),
        plt.Line2D([], [], color=LANE[0], label="lane 0 (local rank 0 of each node)"),
        plt.Line2D([], [], color=LANE[1], label="lane 1 (local rank 1 of each node)"),
        plt.Line2D([], [], color=ARENA, label="shared memory inside a node"),
    ]
    ax.legend(
        handles=handles,
        loc="upper center",
        fontsize=8,
        frameon=False,
        ncol=2,
        bbox_to_anchor=(0.5, 0.04),
    )
    return fig


DOCS = Path(__file__).resolve().parent.parent / "docs"


def digits_metrics() -> str:
    """``shardwire plot`` of the main job's run directory kept in ``docs/data``."""
    from shardwire.worker.launcher.plot import plot

    with tempfile.TemporaryDirectory() as scratch:
        out = plot(DOCS / "data" / "digits-full_shard-seed0", Path(scratch) / "metrics.svg")
        return out.read_text()


def slowdemo_timeline() -> str:
    """The why-slow run's timeline (``docs/data/slowdemo-trace.json``): a few steps of
    the four ranks' all_reduce slices, each split into waiting, reducing and moving."""
    doc = json.loads((DOCS / "data" / "slowdemo-trace.json").read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    begins = {(e["pid"], e["id"]): e for e in events if e.get("ph") == "b"}
    slices = []
    for e in events:
        b = begins.get((e.get("pid"), e.get("id")))
        if e.get("ph") == "e" and b is not None and 20 < b["args"]["seq"] <= 25:
            slices.append((b["pid"], b["ts"], e["ts"], b["args"]))
    origin = min(s[1] for s in slices)
    fig, ax = plt.subplots(figsize=(8.0, 2.6))
    colors = {"wait_ms": "#c8c8c8", "reduce_ms": "#d62728", "move_ms": "#1f77b4"}
    for rank, start, end, args in slices:
        at = (start - origin) / 1000
        scale = (end - start) / 1000 / max(1e-9, sum(args[k] for k in colors))
        for key, color in colors.items():
            width = args[key] * scale
            ax.barh(rank, width, left=at, height=0.6, color=color, edgecolor="none")
            at += width
    ax.set_yticks(range(4), [f"rank {r}" for r in range(4)])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("ms (all_reduce calls 21 to 25)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    labels = ["waiting for peers", "reducing", "moving bytes"]
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 1.25),
        ncol=3,
        frameon=False,
        fontsize=8,
    )
    fig.tight_layout()
    return _svg(fig)


FIGURES = {
    "img/architecture.svg": architecture,
    "img/digits-metrics.svg": digits_metrics,
    "img/slowdemo-timeline.svg": slowdemo_timeline,
}
