"""Point-to-point throughput and round-trip time: shardwire's TCP transport next to a raw
socket baseline (blocking ``sendall`` / ``recv_into``), measured in the same run, with
shardwire's data-frame checksums on (the default) and off, and with TLS, so the cost of
each is a column.

    shardwire bench transport [--sizes 4K 64K 1M 16M 64M 256M] [--json out.json]

Both sides run in two separate processes over loopback. Throughput: one side sends
``reps`` messages of each size, the other receives them into a preallocated buffer and
answers with one byte; the sender times the whole exchange. Round trip: ping-pong of one
message, median over many. Each cell is the best of ``--trials`` rounds, the two sides
alternating round by round, since the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from shardwire.worker.bench.certs import make_certificates
from shardwire.worker.bench.jobs import command_line
from shardwire.worker.bench.stages import Stages

TOTAL_BYTES = 256 << 20  # per throughput trial
RTT_ITERS = 2000
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.upper().removesuffix("B").removesuffix("I")
    if text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def reps_for(size: int) -> int:
    return max(3, min(5000, TOTAL_BYTES // size))


# ---- raw sockets ------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def raw_peer(port: int, sizes: list[int], trials: int) -> None:
    """The receiving side of the raw baseline (runs in a child process)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for size in sizes:
        buf = memoryview(bytearray(size))
        for _ in range(trials):
            for _ in range(reps_for(size)):
                _recv_exact(sock, buf)
            sock.sendall(b"k")
    ping = memoryview(bytearray(4096))
    for _ in range(RTT_ITERS):
        _recv_exact(sock, ping)
        sock.sendall(ping)
    sock.close()


def raw_side(sizes: list[int], trials: int) -> dict:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardwire.worker.bench.transport",
            "--raw-peer",
            str(port),
            "--trials",
            str(trials),
            "--sizes",
            *map(str, sizes),
        ]
    )
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = memoryview(bytearray(1))
    result: dict = {"throughput": {}, "rtt_us": 0.0}
    for size in sizes:
        data = memoryview(np.ones(size, np.uint8).data)
        best = 0.0
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(reps_for(size)):
                sock.sendall(data)
            _recv_exact(sock, ack)
            best = max(best, size * reps_for(size) / (time.perf_counter() - start))
        result["throughput"][size] = best
    ping = memoryview(bytearray(4096))
    samples = []
    for _ in range(RTT_ITERS):
        start = time.perf_counter()
        sock.sendall(ping)
        _recv_exact(sock, ping)
        samples.append(time.perf_counter() - start)
    result["rtt_us"] = statistics.median(samples) * 1e6
    sock.close()
    server.close()
    child.wait(timeout=60)
    return result


# ---- shardwire ----------------------------------------------------------------------------


async def shardwire_worker(sizes: list[int], trials: int) -> dict | None:
    import shardwire.worker as sw

    async with sw.init() as pg:
        t = pg.transport
        peer = 1 - pg.rank
        seq = 0
        result: dict = {"throughput": {}, "rtt_us": 0.0}
        for size in sizes:
            buf = np.ones(size, np.uint8)
            ack = np.zeros(1, np.uint8)
            best = 0.0
            for _ in range(trials):
                reps = reps_for(size)
                if pg.rank == 0:
                    start = time.perf_counter()
                    for i in range(reps):
                        await t.send(peer, buf, tag=sw.Tag(0, seq + i))
                    await t.recv(peer, tag=sw.Tag(1, seq), out=ack)
                    best = max(best, size * reps / (time.perf_counter() - start))
                else:
                    for i in range(reps):
                        await t.recv(peer, tag=sw.Tag(0, seq + i), out=buf)
                    await t.send(peer, ack, tag=sw.Tag(1, seq))
                seq += reps
            result["throughput"][size] = best
        ping = np.zeros(4096, np.uint8)
        samples = []
        for i in range(RTT_ITERS):
            if pg.rank == 0:
                start = time.perf_counter()
                await t.send(peer, ping, tag=sw.Tag(2, i))
                await t.recv(peer, tag=sw.Tag(3, i), out=ping)
                samples.append(time.perf_counter() - start)
            else:
                await t.recv(peer, tag=sw.Tag(2, i), out=ping)
                await t.send(peer, ping, tag=sw.Tag(3, i))
        if pg.rank != 0:
            return None
        result["rtt_us"] = statistics.median(samples) * 1e6
        return result


# shardwire configurations measured side by side: name -> extra environment ("tls" gets
# its certificate files in main(); it runs over TCP only, since TLS covers connections
# and the two ranks of one host would otherwise move large payloads through shared
# memory, which never leaves the host: its cost is measured against "tcp only").
VARIANTS: dict[str, dict[str, str]] = {
    "shardwire": {},
    "no checksum": {"SHARDWIRE_CHECKSUM": "0"},
    "tcp only": {"SHARDWIRE_TRANSPORT": "tcp"},  # the two ranks share a node: shm above
    "tls": {},
}


def shardwire_side(sizes: list[int], trials: int, extra_env: dict[str, str]) -> dict:
    out = Path(f"/tmp/shardwire-bench-{os.getpid()}.json")
    shardwire = Path(sys.executable).parent / "shardwire"
    cmd = [
        str(shardwire),
        "launch",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "shardwire.worker.bench.transport",
        "--shardwire-worker",
        str(out),
        "--trials",
        str(trials),
        "--sizes",
        *map(str, sizes),
    ]
    subprocess.run(
        cmd, check=True, timeout=1800, stdout=subprocess.DEVNULL, env={**os.environ, **extra_env}
    )
    result = json.loads(out.read_text())
    out.unlink()
    return {
        "throughput": {int(k): v for k, v in result["throughput"].items()},
        "rtt_us": result["rtt_us"],
    }


def best_of(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {
        "throughput": {k: max(a["throughput"][k], b["throughput"][k]) for k in b["throughput"]},
        "rtt_us": min(a["rtt_us"], b["rtt_us"]),
    }


# ---- report -------------------------------------------------------------------------------


def report(sizes: list[int], raw: dict, variants: dict[str, dict]) -> list[dict]:
    """Print the table (GB/s per variant, its ratio to raw) and return its rows."""
    rows = []
    names = list(variants)
    head = f"{'size':>10} {'raw GB/s':>10}" + "".join(f" {n + ' GB/s':>18}" for n in names)
    print(head + f" {'ratio':>7} {'checksum cost':>14} {'tls cost':>9}")
    for size in sizes:
        r = raw["throughput"][size] / 1e9
        got = {n: variants[n]["throughput"][size] / 1e9 for n in names}
        main, plain = got["shardwire"], got.get("no checksum", got["shardwire"])
        tcp = got.get("tcp only", main)
        cost, tls_cost = 1 - main / plain, 1 - got.get("tls", tcp) / tcp
        rows.append({"size": size, "raw_gbps": r, **{f"{n}_gbps": g for n, g in got.items()}})
        rows[-1].update(ratio=main / r, checksum_cost=cost, tls_cost=tls_cost)
        cells = "".join(f" {got[n]:>18.2f}" for n in names)
        print(
            f"{human(size):>10} {r:>10.2f}{cells} {main / r:>7.2f} {cost:>13.1%} {tls_cost:>9.1%}"
        )
    rtts = ", ".join(f"{n} {v['rtt_us']:.1f} us" for n, v in variants.items())
    print(f"\n4 KiB round trip: raw {raw['rtt_us']:.1f} us, {rtts}")
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench transport``."""
    p = command_line("transport", __doc__)
    p.add_argument(
        "--sizes",
        nargs="+",
        default=["4K", "64K", "1M", "16M", "64M", "256M"],
        help="message sizes in bytes, each a row: 4096, or with K, M, G (1024-based) "
        "(4K 64K 1M 16M 64M 256M)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=5,
        help="rounds per cell, the sides alternating round by round; each cell is the best "
        "round (%(default)s)",
    )
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--raw-peer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shardwire-worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]
    if args.raw_peer:
        raw_peer(args.raw_peer, sizes, args.trials)
        return
    if args.shardwire_worker:
        import shardwire.worker as sw

        result = sw.run(shardwire_worker(sizes, args.trials))
        if result is not None:
            Path(args.shardwire_worker).write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="shardwire-bench-tls-") as directory:
        tls = make_certificates(Path(directory)).member.env()
        VARIANTS["tls"] = {**tls, "SHARDWIRE_TRANSPORT": "tcp"}
        raw, done = measure(sizes, args.trials)
    rows = report(sizes, raw, done)
    if args.json:
        rtt = {"raw": raw["rtt_us"], **{n: r["rtt_us"] for n, r in done.items()}}
        Path(args.json).write_text(json.dumps({"throughput": rows, "rtt_us": rtt}, indent=2))


def measure(sizes: list[int], trials: int) -> tuple[dict, dict[str, dict]]:
    """Best of ``trials`` rounds for raw sockets and every variant."""
    # Alternate the sides so that drift on this shared machine hits them all alike.
    raw = None
    results: dict[str, dict | None] = dict.fromkeys(VARIANTS)
    with Stages("transport", trials * (1 + len(VARIANTS))) as progress:
        for trial in range(trials):
            progress.start(f"round {trial + 1}/{trials}: raw sockets")
            raw = best_of(raw, raw_side(sizes, 1))
            for name, extra in VARIANTS.items():
                progress.start(f"round {trial + 1}/{trials}: {name}")
                results[name] = best_of(results[name], shardwire_side(sizes, 1, extra))
    assert raw is not None
    return raw, {name: r for name, r in results.items() if r is not None}


if __name__ == "__main__":
    main()
