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
import sys
from pathlib import Path

from shardwire.worker.bench import c10d as c10d_module
from shardwire.worker.bench.hosts import Hosts, emulated, rate_bits
from shardwire.worker.bench.jobs import run_nodes
from shardwire.worker.bench.timing import busbw_factor, human, summarized

_GLOO_PORT = 29530  # rank 0's rendezvous port for gloo, inside the first host's namespace


def shardwire_cells(hosts: Hosts, per_host: int, config: dict, tmp: str) -> list[dict]:
    out = os.path.join(tmp, "shardwire.json")
    where = [(hosts.prefix(i), hosts.address(i)) for i in range(hosts.count)]
    run_nodes(
        ["-m", "shardwire.worker.bench.measure", out, json.dumps(config)],
        hosts.count * per_host,
        hosts.count,
        dict(os.environ),
        hosts=where,
    )
    return json.loads(Path(out).read_text())


def gloo_cells(hosts: Hosts, per_host: int, config: dict, python: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, "gloo.json")
    n = hosts.count * per_host
    procs = []
    try:
        for rank in range(n):
            host = rank // per_host
            rank_config = {**config, "n": n, "backend": "gloo", "rank": rank,
                           "master": hosts.address(0), "port": _GLOO_PORT,
                           "ifname": hosts.device(host)}  # fmt: skip
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
                )  # fmt: skip
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


def _row(cell: dict, gloo: dict | None, link_Bps: float | None, hosts: int) -> dict:
    n, op, nbytes = cell["n"], cell["op"], cell["bytes"]
    factor = busbw_factor(op, n)
    row = {
        "op": op, "n": n, "hosts": hosts, "bytes": nbytes, "algorithm": cell["algorithm"],
        "median_us": cell["median_s"] * 1e6,
        "busbw_GBps": nbytes / cell["median_s"] / 1e9 * factor,
    }  # fmt: skip
    if link_Bps:
        row["link_fraction"] = row["busbw_GBps"] * 1e9 / link_Bps
    if gloo is not None and "median_s" in gloo:
        row["gloo_median_us"] = gloo["median_s"] * 1e6
        row["gloo_busbw_GBps"] = nbytes / gloo["median_s"] / 1e9 * factor
        row["vs_gloo"] = gloo["median_s"] / cell["median_s"]
        if link_Bps:
            row["gloo_link_fraction"] = row["gloo_busbw_GBps"] * 1e9 / link_Bps
    return row


def print_table(rows: list[dict], rate: str | None) -> None:
    """Bus bandwidth as a fraction of the link's rate (in GB/s where the link is not
    shaped), shardwire's and gloo's, and gloo's time over shardwire's."""
    mine, theirs, fmt = ("link_fraction", "gloo_link_fraction", ".2f")
    if rate:
        print(f"bus bandwidth as a fraction of the {rate} link (1.0: the link is full)")
    else:
        mine, theirs, fmt = ("busbw_GBps", "gloo_busbw_GBps", ".3f")
        print("bus bandwidth in GB/s (unshaped links)")
    print(
        "| op | hosts | ranks | size | algorithm | shardwire | gloo | gloo time / shardwire time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gloo = format(r[theirs], fmt) if theirs in r else "-"
        vs = f"{r['vs_gloo']:.2f}" if "vs_gloo" in r else "-"
        print(f"| {r['op']} | {r['hosts']} | {r['n']} | {human(r['bytes'])} | "
              f"{r['algorithm']} | {format(r[mine], fmt)} | {gloo} | {vs} |")  # fmt: skip
    print("tc tbf shapes the rate only (no netem here): no added delay or loss")


def _sizes(hosts: Hosts, one: dict, *, per_host: int, gloo: str | None, tmp: str, turn: int):
    """Both systems at one size, shardwire first on even turns and last on odd ones."""
    systems = ["ours", "gloo"] if gloo else ["ours"]
    got = {}
    for name in systems if turn % 2 == 0 else systems[::-1]:
        if name == "ours":
            got[name] = shardwire_cells(hosts, per_host, one, tmp)
        else:
            assert gloo is not None
            got[name] = gloo_cells(hosts, per_host, one, gloo, tmp)
    return got


def run(
    hosts_list: list[int], *, per_host: int, rate: str | None, config: dict,
    gloo: str | None, tmp: str,
) -> list[dict]:  # fmt: skip
    """Every cell on every host count, shardwire and gloo alternating first size by size."""
    link = rate_bits(rate) / 8 if rate else None
    rows = []
    for count in hosts_list:
        with emulated(count, rate) as hosts:
            for turn, size in enumerate(config["sizes"]):
                one = {**config, "sizes": [size]}
                got = _sizes(hosts, one, per_host=per_host, gloo=gloo, tmp=tmp, turn=turn)
                theirs = {(c["op"], c["bytes"]): c for c in got.get("gloo", [])}
                for cell in got["ours"]:
                    rows.append(_row(cell, theirs.get((cell["op"], cell["bytes"])), link, count))
                print(f"[bench]: {count} hosts, {human(size)} done", file=sys.stderr, flush=True)
    return rows
