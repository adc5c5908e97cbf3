"""The slow-links guide's figures, made from the benchmark runs kept in
``docs/data/bench/hosts.json`` (``shardwire bench collectives --hosts``) and
``docs/data/bench/slowlink.json`` (``shardwire bench slowlink``), each with its command,
date, commit and machine beside the rows: the tables between the guide's
``<!-- generated: hosts -->`` and ``<!-- generated: slowlink -->`` marks, and the plot of
held-out loss against tokens. ``docs_reference.py`` writes them and ``--check`` fails
when one is stale."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from diagrams import _svg

from shardwire.worker.bench.across import tuning_label
from shardwire.worker.bench.slowlink import figure

DOCS = Path(__file__).resolve().parent.parent / "docs"
HOSTS = DOCS / "data" / "bench" / "hosts.json"
SLOWLINK = DOCS / "data" / "bench" / "slowlink.json"
PAGE = DOCS / "guide" / "slow-links.md"
PLOT = DOCS / "img" / "slowlink-loss.svg"


def marks(name: str) -> re.Pattern[str]:
    """A page's generated section ``name``: its opening mark, its text, its end mark."""
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(<!-- end generated -->)", re.S)


def kept_run(path: Path) -> dict[str, Any]:
    """A kept run: its command, date, commit and machine beside what it wrote."""
    kept = json.loads(path.read_text())
    return {**kept, **kept["result"]} if "result" in kept else kept


def size(n: int) -> str:
    """A byte count as the tables show it (KiB or MiB)."""
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def source(kept: dict[str, Any]) -> str:
    """The sentence that names a kept run: its command, date, commit and machine."""
    return (
        f"Measured by `{kept['benchmark']}` on {kept['date']} (commit {kept['commit']}; "
        f"{kept['machine']})."
    )


def hosts_table() -> str:
    kept = kept_run(HOSTS)
    tcp = kept.get("tcp", {})
    both = bool(tcp) and tcp["shardwire"] != tcp["default"]  # also timed with the defaults
    if both:
        ours, kernel = tuning_label(tcp["shardwire"]), tuning_label(tcp["default"])
        head = (
            f"| op | hosts | size | algorithm | shardwire ({ours}) | shardwire ({kernel}) "
            f"| gloo ({kernel}) | gloo time / shardwire time ({ours}) | ({kernel}) |"
        )
        asked = any(v is not None for v in kept.get("asked", {}).values())
        how = (
            "as asked (`SHARDWIRE_TCP_CONGESTION`, `SHARDWIRE_TCP_NOTSENT_LOWAT`)"
            if asked
            else "as they are between hosts when nothing is asked"
        )
        said = (
            f" shardwire's peer connections ran with TCP tuned ({ours}), {how}, and, in runs "
            f"beside them, with the kernel's defaults ({kernel}), which gloo uses."
        )
    else:
        head = "| op | hosts | size | algorithm | shardwire | gloo | gloo time / shardwire time |"
        said = ""
    out = [
        source(kept) + " Bus bandwidth as a fraction of the link's rate; the time columns "
        "are gloo's median time over shardwire's (above 1, shardwire is faster)." + said,
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in kept["rows"]:
        gloo = f"{r['gloo_link_fraction']:.2f}" if "gloo_link_fraction" in r else "-"
        vs = f"{r['vs_gloo']:.2f}" if "vs_gloo" in r else "-"
        cells = [r["op"], str(r["hosts"]), size(r["bytes"]), r["algorithm"]]
        cells.append(f"{r['link_fraction']:.2f}")
        if both:
            cells.append(f"{r['default_tcp_link_fraction']:.2f}")
        cells += [gloo, vs]
        if both:
            cells.append(f"{r['default_tcp_vs_gloo']:.2f}" if "default_tcp_vs_gloo" in r else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def slowlink_table() -> str:
    kept = kept_run(SLOWLINK)
    model = kept["model"]
    outer = (
        "the paper's outer optimizer"
        if (kept["outer_lr"], kept["outer_momentum"]) == (0.7, 0.9)
        else f"outer rate {kept['outer_lr']:g} and momentum {kept['outer_momentum']:g}"
        + (
            " (the replicas' parameters averaged)"
            if kept["outer_lr"] == 1 and kept["outer_momentum"] == 0
            else ""
        )
    )
    out = [
        source(kept) + f" charlm (dim {model['dim']}, {model['layers']} layers, batch "
        f"{model['batch']} × {model['context']} characters); DiLoCo with H = {kept['every']}, "
        f"{outer}, and, streaming, {kept['fragments']} fragments. Tokens/s: a run of "
        f"{kept['steps']} steps at each rate. Held-out loss, bytes and the largest exchange: "
        f"one run of {kept['loss_steps']:,} steps per mode and host count on unshaped links "
        "(a link's rate changes how fast a mode trains, not what it computes).",
        "",
        "| hosts | link | mode | tokens/s | held-out loss | bytes over a link per token "
        "| largest outer exchange |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in kept["rows"]:
        peak = r["largest_exchange_bytes"]
        shown = "-" if peak is None else f"{peak / 2**20:.2f} MiB"
        out.append(
            f"| {r['hosts']} | {r['rate']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
            f"{r['held_out_loss']:.4f} | {r['cross_host_bytes_per_token']:,.1f} | {shown} |"
        )
    out += [
        "",
        "![Held-out loss against tokens, per mode, for each host count](../img/slowlink-loss.svg)",
        "",
    ]
    return "\n".join(out)


def page() -> str:
    """The guide with its generated parts brought up to date."""
    text = PAGE.read_text()
    for name, make in (("hosts", hosts_table), ("slowlink", slowlink_table)):
        section = marks(name)
        if not section.search(text):
            raise SystemExit(f"{PAGE} has no <!-- generated: {name} --> marks")
        text = section.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(3), text)
    return text


def plot() -> str:
    """Held-out loss against tokens, a panel per host count, a line per mode."""
    return _svg(figure(kept_run(SLOWLINK)["curves"]))
