"""The pages' measured figures, made from the benchmark runs kept in ``docs/data/bench``
(``keep_bench.py`` writes each with its command, date, commit and machine) and from the
kept trace of the why-slow page's run: each between a page's ``<!-- generated: NAME -->``
and ``<!-- end generated -->`` marks. The tables are the benchmarks' own (their
``table``), so a page shows what the benchmark printed. ``docs_reference.py`` writes
them and ``--check`` fails when one is stale."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slowlink_pages import marks, size, source

from shardwire.worker.bench import aggregation, checkpoint, offload, parallel

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEPT = DOCS / "data" / "bench"


def _kept(name: str) -> dict[str, Any]:
    return json.loads((KEPT / f"{name}.json").read_text())


def transport() -> str:
    kept = _kept("transport")
    rows, rtt = kept["result"]["throughput"], kept["result"]["rtt_us"]
    out = [
        source(kept) + " Point-to-point between two ranks of one host, best of the trials, "
        "GB/s of payload. TLS runs over TCP only (it covers connections; shared memory never "
        "leaves the host): its cost is against TCP only, the checksum's against no checksum.",
        "",
        "| size | raw sockets | shardwire (shared memory) | no checksum | TCP only | TLS "
        "| checksum cost | TLS cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {size(r['size'])} | {r['raw_gbps']:.2f} | {r['shardwire_gbps']:.2f} | "
            f"{r['no checksum_gbps']:.2f} | {r['tcp only_gbps']:.2f} | {r['tls_gbps']:.2f} | "
            f"{r['checksum_cost']:.0%} | {r['tls_cost']:.0%} |"
        )
    trips = ", ".join(f"{name} {us:.0f} µs" for name, us in rtt.items())
    return "\n".join([*out, "", f"A 4 KiB round trip: {trips}.", ""])


def _table(name: str, make: Callable[[Any], str], lead: str) -> Callable[[], str]:
    def render() -> str:
        kept = _kept(name)
        return "\n".join([source(kept) + lead, "", make(kept["result"]), ""])

    return render


def trace() -> str:
    kept = _kept("trace")
    out = [
        source(kept) + " Tokens/s of charlm with and without `--trace`, alternating; the "
        "cost is the untraced median over the traced one.",
        "",
        "| ranks | untraced tokens/s | traced tokens/s | cost | events a rank recorded |",
        "|---|---|---|---|---|",
    ]
    for r in kept["result"]:
        plain = statistics.median(r["untraced_tokens_per_s"])
        timed = statistics.median(r["traced_tokens_per_s"])
        out.append(
            f"| {r['ranks']} | {plain:,.0f} | {timed:,.0f} | {r['overhead_percent']:+.1f} % | "
            f"{r['events_per_rank']:,} |"
        )
    return "\n".join([*out, ""])


def slowdemo() -> str:
    """The why-slow run's all_reduce slices, per rank, from its kept trace."""
    events = json.loads((DOCS / "data" / "slowdemo-trace.json").read_text())["traceEvents"]

    def key(e: dict[str, Any]) -> tuple[int, str]:  # a call's id is the same on every rank
        return e["pid"], e["id"]

    begins = {key(e): e for e in events if e.get("ph") == "b" and e["name"] == "all_reduce"}
    ends = {key(e): e for e in events if e.get("ph") == "e" and key(e) in begins}
    ranks: dict[int, list[dict[str, float]]] = {}
    for key, begin in begins.items():
        slice_ms = (ends[key]["ts"] - begin["ts"]) / 1000
        ranks.setdefault(begin["pid"], []).append({"ms": slice_ms, **begin["args"]})
    keys = ("ms", "wait_ms", "reduce_ms", "move_ms")
    med = {
        rank: {k: statistics.median(s[k] for s in slices) for k in keys}
        for rank, slices in sorted(ranks.items())
    }
    out = [
        f"The kept trace holds {len(begins) // len(med)} steps of each rank; the median "
        "all_reduce slice per rank, and its split:",
        "",
        "| rank | slice ms | wait_ms | reduce_ms | move_ms |",
        "|---|---|---|---|---|",
    ]
    for rank, m in med.items():
        out.append(
            f"| {rank} | {m['ms']:.1f} | {m['wait_ms']:.1f} | {m['reduce_ms']:.2f} | "
            f"{m['move_ms']:.2f} |"
        )
    return "\n".join([*out, ""])


FIGURES: dict[str, tuple[str, Callable[[], str]]] = {
    "transport": ("guide/performance.md", transport),
    "checkpoint": (
        "guide/performance.md",
        _table(
            "checkpoint",
            checkpoint.table,
            " A blocking save against one fsynced "
            "`numpy.save` of the same bytes, a load, and an asynchronous save's stall.",
        ),
    ),
    "parallel": (
        "guide/performance.md",
        _table(
            "parallel",
            parallel.table,
            " The pipeline bubble per schedule, measured "
            "beside its theory, and a small LM's step under FSDP and tensor parallel.",
        ),
    ),
    "offload": (
        "guide/fsdp.md",
        _table(
            "offload",
            offload.table,
            " Peak resident memory per rank over the "
            "training steps (`VmHWM`), FULL_SHARD with AdamW.",
        ),
    ),
    "aggregation": (
        "guide/aggregation.md",
        _table(
            "aggregation",
            aggregation.table,
            " digits with top-k 1 % gradients and "
            "error feedback beside uncompressed ones, and the parameter server's step "
            "beside the ring all-reduce's.",
        ),
    ),
    "trace": ("why-slow.md", trace),
    "slowdemo": ("why-slow.md", slowdemo),
}


def pages(made: dict[Path, str]) -> dict[Path, str]:
    """Every page that holds figures, with them brought up to date (from its text in
    ``made`` where another generator made it first)."""
    texts: dict[Path, str] = {}
    for name, (page, render) in FIGURES.items():
        path = DOCS / page
        text = texts.get(path) or made.get(path) or path.read_text()
        section = marks(name)
        if not section.search(text):
            raise SystemExit(f"{path} has no <!-- generated: {name} --> marks")
        texts[path] = section.sub(lambda m, r=render: m.group(1) + r() + "\n" + m.group(3), text)
    return texts
