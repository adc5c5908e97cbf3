"""``shardwire bench collectives``: time every collective for float32 sizes 4 KiB-256 MiB
on N local processes, next to gloo measured in the same invocation (``--compare-gloo``).

Prints median latency, algorithm and bus bandwidth per cell as a table, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench import gloo as gloo_module
from shardwire.worker.bench.rawsocket import two_way_throughput
from shardwire.worker.bench.timing import OPS, SIZES, busbw_factor, human, parse_size, summarize


def _shardwire_cells(n: int, config: dict, tmp: str, transport: str = "auto") -> list[dict]:
    out = os.path.join(tmp, f"shardwire-{n}-{transport}.json")
    cmd = [
        sys.executable,
        "-m",
        "shardwire.worker.launcher.cli",
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        "shardwire.worker.bench.measure",
        out,
        json.dumps(config),
    ]
    env = {**os.environ, "SHARDWIRE_TRANSPORT": transport}
    subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL, env=env)
    return json.loads(Path(out).read_text())


def _gloo_cells(n: int, config: dict, python: str, tmp: str) -> list[dict]:
    out = os.path.join(tmp, f"gloo-{n}.json")
    cmd = [python, gloo_module.__file__, out, json.dumps({**config, "n": n})]
    subprocess.run(
        cmd,
        check=True,
        timeout=3600,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    cells = []
    for record in json.loads(Path(out).read_text()):
        if "times" in record:
            record.update(summarize(record.pop("times")))
        cells.append(record)
    return cells


def _gloo_python(requested: str | None) -> str | None:
    candidates = (
        [requested]
        if requested
        else [sys.executable, str(Path.home() / ".cache/gloo-venv/bin/python")]
    )
    for python in candidates:
        if python and (shutil.which(python) or Path(python).exists()):
            probe = subprocess.run(
                [python, "-c", "import torch.distributed"], capture_output=True, check=False
            )
            if probe.returncode == 0:
                return python
    return None


def _row(cell: dict, gloo: dict | None, tcp: dict | None = None) -> dict:
    n, op, nbytes = cell["n"], cell["op"], cell["bytes"]
    busbw = nbytes / cell["median_s"] / 1e9 * busbw_factor(op, n)
    row = {
        "op": op,
        "n": n,
        "bytes": nbytes,
        "algorithm": cell["algorithm"],
        "median_us": cell["median_s"] * 1e6,
        "busbw_GBps": busbw,
        "iters": cell["iters"],
    }
    if gloo and "median_s" in gloo:
        gloo_busbw = nbytes / gloo["median_s"] / 1e9 * busbw_factor(op, n)
        row.update(
            gloo_median_us=gloo["median_s"] * 1e6,
            gloo_busbw_GBps=gloo_busbw,
            speedup=gloo["median_s"] / cell["median_s"],
        )
    if tcp:
        row.update(
            tcp_busbw_GBps=nbytes / tcp["median_s"] / 1e9 * busbw_factor(op, n),
            over_tcp=tcp["median_s"] / cell["median_s"],
        )
    return row


def _print_table(rows: list[dict], raw_two_way: float | None) -> None:
    has_gloo = any("speedup" in r for r in rows)
    has_tcp = any("over_tcp" in r for r in rows)
    head = "| op | n | size | algorithm | median (us) | busbw (GB/s) |"
    if has_tcp:
        head += " tcp only busbw (GB/s) | vs tcp only |"
    if has_gloo:
        head += " gloo median (us) | gloo busbw (GB/s) | shardwire/gloo |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = (
            f"| {r['op']} | {r['n']} | {human(r['bytes'])} | {r['algorithm']} | "
            f"{r['median_us']:.1f} | {r['busbw_GBps']:.3f} |"
        )
        if has_tcp:
            line += f" {r['tcp_busbw_GBps']:.3f} | {r['over_tcp']:.2f}x |"
        if has_gloo:
            if "speedup" in r:
                line += (
                    f" {r['gloo_median_us']:.1f} | {r['gloo_busbw_GBps']:.3f} | "
                    f"{r['speedup']:.2f}x |"
                )
            else:
                line += " - | - | - |"
        print(line)
    if raw_two_way is not None:
        print(
            f"\nraw loopback socket, both directions at once, 64 MiB: "
            f"{raw_two_way / 1e9:.2f} GB/s per direction"
        )
        for r in rows:
            if r["op"] == "all_reduce" and r["n"] == 2 and r["bytes"] == 64 << 20:
                print(
                    f"2-rank 64 MiB all_reduce bus bandwidth = "
                    f"{r['busbw_GBps'] * 1e9 / raw_two_way:.0%} of that"
                )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwire bench collectives", description=__doc__)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", nargs="+", default=SIZES)
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS)
    p.add_argument("--target-s", type=float, default=1.0, help="seconds per cell")
    p.add_argument("--compare-gloo", action="store_true", help="also time torch's gloo")
    p.add_argument(
        "--gloo-python",
        help="interpreter with torch (default: this one, or ~/.cache/gloo-venv/bin/python)",
    )
    p.add_argument(
        "--compare-tcp",
        action="store_true",
        help="also time shardwire with SHARDWIRE_TRANSPORT=tcp (no shared memory)",
    )
    p.add_argument("--json", help="write all rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = {
        "ops": args.ops,
        "sizes": [parse_size(s) for s in args.sizes],
        "target_s": args.target_s,
    }
    gloo_python = _gloo_python(args.gloo_python) if args.compare_gloo else None
    if args.compare_gloo and gloo_python is None:
        print(
            "--compare-gloo: no interpreter with torch found (pip install torch)", file=sys.stderr
        )
        return 2
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world:
            ours = _shardwire_cells(n, config, tmp)
            tcp = _shardwire_cells(n, config, tmp, "tcp") if args.compare_tcp else []
            theirs = _gloo_cells(n, config, gloo_python, tmp) if gloo_python else []
            by_key = {(g["op"], g["bytes"]): g for g in theirs}
            tcp_key = {(t["op"], t["bytes"]): t for t in tcp}
            rows += [
                _row(c, by_key.get((c["op"], c["bytes"])), tcp_key.get((c["op"], c["bytes"])))
                for c in ours
            ]
    raw = two_way_throughput(64 << 20) if 2 in args.world else None
    _print_table(rows, raw)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "raw_two_way_Bps": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
