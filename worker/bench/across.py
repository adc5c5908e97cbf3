"""``shardwire bench collectives --hosts N --link RATE``: the collectives across emulated
hosts (:mod:`shardwire.worker.bench.hosts`), shardwire beside torch's gloo size by size,
with bus bandwidth as a fraction of the link's rate (1.0 is what the link can carry).

Across real hosts, without namespaces, the same cells come from ``shardwire worker -m
shardwire.worker.bench.measure OUT CONFIG`` on every host (see the performance guide).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench import c10d as c10d_module
from shardwire.worker.bench.hosts import Hosts, emulated, rate_bits
from shardwire.worker.bench.jobs import run_nodes
from shardwire.worker.bench.stages import Stages
from shardwire.worker.bench.timing import busbw_factor, human, summarized
from shardwire.worker.transport import tcptuning

_GLOO_PORT = 29530  # rank 0's rendezvous port for gloo, inside the first host's namespace


_ENV = {"congestion": "SHARDWIRE_TCP_CONGESTION", "notsent_lowat": "SHARDWIRE_TCP_NOTSENT_LOWAT"}
# The kernel's defaults on every peer connection, asked for explicitly.
KERNEL_TCP = {"congestion": tcptuning.KERNEL, "notsent_lowat": 0}


def tuning_label(tcp: dict[str, Any]) -> str:
    """What a run's sockets used, for a column's head: ``cubic, lowat 256 KiB``. Each
    value is one setting or the list of those its connections used (a mark of 0 or
    None: the kernel's, no mark of the connection's own)."""

    def values(key: str) -> list[Any]:
        got = tcp.get(key)
        return list(got) if isinstance(got, list) else [got]

    names = [n for n in values("congestion") if n]
    said = ["/".join(names) if names else "kernel's congestion control"]
    marks = values("notsent_lowat")
    if any(marks):
        said.append("lowat " + "/".join(human(m) if m else "none" for m in marks))
    return ", ".join(said)


def tuning_env(tuning: dict[str, Any] | None) -> dict[str, str]:
    """The environment that asks shardwire's peer connections for ``tuning``'s settings
    (a None or absent one is left to shardwire's automatic choice)."""
    asked = {k: v for k, v in (tuning or {}).items() if v is not None}
    return {_ENV[k]: str(v) for k, v in asked.items()}


def _expected(key: str, value: Any) -> Any:
    """What the sockets report for an asked ``value`` (None: unknown here, the kernel's
    algorithm inside the hosts' namespaces)."""
    return None if key == "congestion" and value == tcptuning.KERNEL else value


def shardwire_cells(
    hosts: Hosts, per_host: int, config: dict, tmp: str, *, tuning: dict[str, Any] | None = None
) -> list[dict]:
    """shardwire's cells; ``tuning``: its peer connections' TCP settings
    (``congestion``, ``notsent_lowat``; None or absent: shardwire's automatic choice)."""
    out = os.path.join(tmp, "shardwire.json")
    where = [(hosts.prefix(i), hosts.address(i)) for i in range(hosts.count)]
    env = {k: v for k, v in os.environ.items() if k not in _ENV.values()}
    env.update(tuning_env(tuning))
    run_nodes(
        ["-m", "shardwire.worker.bench.measure", out, json.dumps(config)],
        hosts.count * per_host,
        hosts.count,
        env,
        hosts=where,
    )
    cells = json.loads(Path(out).read_text())
    for cell in cells:  # what the workers' sockets used, not what was asked
        for key, value in (tuning or {}).items():
            want = _expected(key, value)
            if want is not None and cell.get("tcp", {}).get(key) != [want]:
                raise BenchmarkFailed(
                    f"asked for TCP {key} {value}, the peer connections used "
                    f"{cell.get('tcp', {}).get(key)}"
                )
    return cells


def tcp_report(rows: list[dict]) -> dict[str, dict[str, list]]:
    """What each column's sockets used over all rows: ``shardwire`` (as asked, else
    shardwire's automatic choice) and ``default`` (the kernel's defaults, which gloo
    also uses; the first column's where only that one ran)."""

    def over(key: str) -> dict[str, list]:
        return {
            k: sorted({v for r in rows for v in r.get(key, {}).get(k, [])})
            for k in ("congestion", "notsent_lowat")
        }

    ours = over("tcp")
    return {"shardwire": ours, "default": over("default_tcp") if kernel_column(rows) else ours}


def kernel_column(rows: list[dict]) -> bool:
    """Whether shardwire also ran with the kernel's TCP defaults beside its own column."""
    return any("default_tcp" in r for r in rows)


def gloo_cells(hosts: Hosts, per_host: int, config: dict, python: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, "gloo.json")
    n = hosts.count * per_host
    procs = []
    try:
        for rank in range(n):
            host = rank // per_host
            rank_config = {
                **config,
                "n": n,
                "backend": "gloo",
                "rank": rank,
                "master": hosts.address(0),
                "port": _GLOO_PORT,
                "ifname": hosts.device(host),
            }
            procs.append(
                subprocess.Popen(
                    [
                        *hosts.prefix(host),
                        python,
                        c10d_module.__file__,
                        out,
                        json.dumps(rank_config),
                    ],
                    # c10d warns that a namespace's address has no name: not news here
                    env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"},
                    stdout=subprocess.DEVNULL,
                )
            )
        for proc in procs:
            if proc.wait(timeout=3600) != 0:
                raise subprocess.CalledProcessError(proc.returncode, proc.args)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    return summarized(out)


def _row(
    cell: dict, gloo: dict | None, link_Bps: float | None, hosts: int, default: dict | None
) -> dict:
    """One cell's row; ``default``: shardwire's same cell with the kernel's TCP defaults
    (asked for explicitly), when the row's own ran otherwise."""
    n, op, nbytes = cell["n"], cell["op"], cell["bytes"]
    factor = busbw_factor(op, n)
    row = {
        "op": op,
        "n": n,
        "hosts": hosts,
        "bytes": nbytes,
        "algorithm": cell["algorithm"],
        "median_us": cell["median_s"] * 1e6,
        "busbw_GBps": nbytes / cell["median_s"] / 1e9 * factor,
        "tcp": cell.get("tcp", {}),  # what the sockets used
    }
    if link_Bps:
        row["link_fraction"] = row["busbw_GBps"] * 1e9 / link_Bps
    if gloo is not None and "median_s" in gloo:
        row["gloo_median_us"] = gloo["median_s"] * 1e6
        row["gloo_busbw_GBps"] = nbytes / gloo["median_s"] / 1e9 * factor
        row["vs_gloo"] = gloo["median_s"] / cell["median_s"]
        if link_Bps:
            row["gloo_link_fraction"] = row["gloo_busbw_GBps"] * 1e9 / link_Bps
    if default is not None and "median_s" in default:
        row["default_tcp_median_us"] = default["median_s"] * 1e6
        row["default_tcp"] = default.get("tcp", {})
        if link_Bps:
            busbw = nbytes / default["median_s"] * factor
            row["default_tcp_link_fraction"] = busbw / link_Bps
        if "gloo_median_us" in row:
            row["default_tcp_vs_gloo"] = row["gloo_median_us"] / row["default_tcp_median_us"]
    return row


def print_table(rows: list[dict], rate: str | None, tcp: dict[str, dict[str, Any]]) -> None:
    """Bus bandwidth as a fraction of the link's rate (in GB/s where the link is not
    shaped), shardwire's and gloo's, and gloo's time over shardwire's; shardwire's with
    the kernel's TCP defaults beside it where that ran. ``tcp``: what each run's sockets
    used (:func:`tcp_report`)."""
    mine, theirs, fmt = ("link_fraction", "gloo_link_fraction", ".2f")
    dflt = "default_tcp_link_fraction"
    if rate:
        print(f"bus bandwidth as a fraction of the {rate} link (1.0: the link is full)")
    else:
        mine, theirs, dflt, fmt = ("busbw_GBps", "gloo_busbw_GBps", "", ".3f")  # no link
        print("bus bandwidth in GB/s (unshaped links)")
    both = kernel_column(rows)
    kernel = tuning_label(tcp["default"])
    ours = f"shardwire ({tuning_label(tcp['shardwire'])})"
    extra = f" shardwire ({kernel}) |" if both else ""
    print(
        f"| op | hosts | ranks | size | algorithm | {ours} |{extra} gloo ({kernel}) "
        "| gloo time / shardwire time |"
    )
    print("|---|---|---|---|---|---|---|---|" + ("---|" if both else ""))
    for r in rows:
        gloo = format(r[theirs], fmt) if theirs in r else "-"
        vs = f"{r['vs_gloo']:.2f}" if "vs_gloo" in r else "-"
        other = (f" {format(r[dflt], fmt)} |" if dflt in r else " - |") if both else ""
        print(
            f"| {r['op']} | {r['hosts']} | {r['n']} | {human(r['bytes'])} | "
            f"{r['algorithm']} | {format(r[mine], fmt)} |{other} {gloo} | {vs} |"
        )
    print("tc tbf shapes the rate only (no netem here): no added delay or loss")


# The systems timed at each size, with what a stage of theirs is called.
_TITLES = {"ours": "shardwire", "default": "shardwire, the kernel's TCP defaults", "gloo": "gloo"}


def _systems(tuning: dict[str, Any] | None, gloo: str | None) -> list[str]:
    """The systems timed at every size: shardwire (with ``tuning``'s settings,
    shardwire's automatic choice for the rest), shardwire with the kernel's TCP defaults
    unless ``tuning`` asked for exactly those, and gloo when there is an interpreter for
    it."""
    kernel = (tuning or {}) != KERNEL_TCP
    return ["ours"] + (["default"] if kernel else []) + (["gloo"] if gloo else [])


def _sizes(
    hosts: Hosts,
    one: dict,
    *,
    per_host: int,
    gloo: str | None,
    tmp: str,
    turn: int,
    tuning: dict[str, Any] | None,
    progress: Stages,
) -> dict[str, list[dict]]:
    """Every system at one size, their order turning size by size."""
    names = _systems(tuning, gloo)
    at = f"{hosts.count} hosts, {human(one['sizes'][0])}"
    got = {}
    for name in names[turn % len(names) :] + names[: turn % len(names)]:
        progress.start(f"{at}: {_TITLES[name]}")
        if name == "gloo":
            assert gloo is not None
            got[name] = gloo_cells(hosts, per_host, one, gloo, tmp)
        else:
            chosen = tuning if name == "ours" else KERNEL_TCP
            got[name] = shardwire_cells(hosts, per_host, one, tmp, tuning=chosen)
    return got


def run(
    hosts_list: list[int],
    *,
    per_host: int,
    rate: str | None,
    config: dict,
    gloo: str | None,
    tmp: str,
    tuning: dict[str, Any] | None = None,
) -> list[dict]:
    """Every cell on every host count, the systems' order turning size by size; a stage
    per system at a size, said on standard error."""
    link = rate_bits(rate) / 8 if rate else None
    total = len(hosts_list) * len(config["sizes"]) * len(_systems(tuning, gloo))
    rows = []
    with Stages("collectives", total) as progress:
        for count in hosts_list:
            with emulated(count, rate) as hosts:
                for turn, size in enumerate(config["sizes"]):
                    one = {**config, "sizes": [size]}
                    got = _sizes(
                        hosts,
                        one,
                        per_host=per_host,
                        gloo=gloo,
                        tmp=tmp,
                        turn=turn,
                        tuning=tuning,
                        progress=progress,
                    )
                    rows += _rows(got, link, count)
    return rows


def _rows(got: dict[str, list[dict]], link: float | None, hosts: int) -> list[dict]:
    """shardwire's cells at one size as rows, the other systems' same cells beside them."""
    theirs = {(c["op"], c["bytes"]): c for c in got.get("gloo", [])}
    default = {(c["op"], c["bytes"]): c for c in got.get("default", [])}
    rows = []
    for cell in got["ours"]:
        key = (cell["op"], cell["bytes"])
        rows.append(_row(cell, theirs.get(key), link, hosts, default.get(key)))
    return rows
