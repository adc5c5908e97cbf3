"""``shardwire bench rendezvous``: how fast a coordinator admits a job of N workers.

    shardwire bench rendezvous [--workers 1000] [--processes 4] [--per-node 8]
                               [--beat-window 5] [--json OUT]

A real coordinator runs as its own process (``python -m shardwire.coordinator``); the
workers are simulated by ``--processes`` client processes, each running its share of
the workers as real control clients in one event loop: handshake, join, placement, then
one lookup of the addresses of the peers a ring and a hypercube connect it to (the
neighbours its collectives use). Each simulated worker times its own join, from
dialling to holding those addresses; then all leave cleanly and the coordinator exits.
Printed and written as JSON:

* ``rendezvous_s``: first dial to the last worker holding its peers' addresses;
* ``join_p50_s`` / ``join_p99_s``: one worker's dial-to-addresses time;
* ``coordinator_cpu_s``: the coordinator's CPU time until every worker had its peers
  (``/proc``);
* ``heartbeat_cpu_share``: the coordinator's CPU seconds per second over the next
  ``--beat-window`` seconds (default 5), while every worker heartbeats once a second
  (the default interval);
* ``coordinator_peak_rss_mib``: its peak resident memory (``VmHWM``).

Nothing here asserts a speed: the figures are for comparing runs on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import coordinator_port

_TIMEOUT = 600.0  # seconds for the whole run (every wait below is bounded by it)


def neighbours(rank: int, world: int) -> list[int]:
    """The peers a ring and a hypercube (recursive doubling) connect ``rank`` to."""
    near = {(rank + 1) % world, (rank - 1) % world}
    near |= {rank ^ (1 << k) for k in range(world.bit_length())}
    return sorted(p for p in near if p != rank and p < world)


async def _workers(port: int, first: int, count: int, world: int, lws: int) -> None:
    """Run workers ``first`` .. ``first + count - 1`` and print their join times (the
    token comes in SHARDWIRE_TOKEN, never on a command line)."""
    token = os.environ["SHARDWIRE_TOKEN"]
    from shardwire.protocol import Token
    from shardwire.protocol.messages import Join
    from shardwire.worker.runtime.control import ControlClient

    clients = [
        ControlClient(token=Token(token), run_id="bench", role="worker") for _ in range(count)
    ]

    async def one(i: int) -> tuple[float, float]:
        rank = first + i
        start = time.time()
        client = clients[i]
        await client.connect("127.0.0.1", port, timeout=_TIMEOUT)
        client.start_heartbeats(1.0)  # from the connection on, as a worker's control thread
        msg = Join(
            world_size=world,
            node_id=f"node-{rank // lws:06d}",
            local_rank=rank % lws,
            local_world_size=lws,
            listen_port=10000 + rank % 50000,
        )
        place = await client.join(msg, timeout=_TIMEOUT)
        members = await client.peers(neighbours(place.rank, world), timeout=_TIMEOUT)
        done = time.time()
        assert [m.rank for m in members] == neighbours(place.rank, world)
        return start, done

    try:
        times = await asyncio.gather(*(one(i) for i in range(count)))
        print(json.dumps(times), flush=True)
        sys.stdin.readline()  # the driver says when every worker has its peers
        for client in clients:
            client.leave()
    finally:
        for client in clients:
            await client.aclose()


def _proc_stats(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return cpu, hwm


def measure(workers: int, processes: int, lws: int, beat_window: float = 5.0) -> dict:
    """One run: a coordinator and ``processes`` client processes for ``workers``; then
    ``beat_window`` seconds of every worker heartbeating."""
    if workers < 1 or workers % lws:
        raise InvalidArgument(f"{workers} workers do not fill nodes of {lws}")
    token = secrets.token_hex(16)
    env = {**os.environ, "SHARDWIRE_TOKEN": token}
    with tempfile.TemporaryDirectory(prefix="shardwire-bench-") as tmp:
        port_file = Path(tmp) / "port"
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "shardwire.coordinator", "--port", "0", "--port-file",
             str(port_file), "--world-size", str(workers), "--run-id", "bench",
             "--http-port", "-1", "--log-level", "WARNING"],
            env=env, stdout=subprocess.DEVNULL, stderr=(Path(tmp) / "log").open("w"),
        )  # fmt: skip
        clients: list[subprocess.Popen] = []
        try:
            port = coordinator_port(port_file, coordinator)
            share = -(-workers // processes)
            for first in range(0, workers, share):
                count = min(share, workers - first)
                clients.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "shardwire.worker.bench.rendezvous",
                            "--client",
                            str(port),
                            str(first),
                            str(count),
                            str(workers),
                            str(lws),
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=env,
                    )  # fmt: skip
                )
            times: list[tuple[float, float]] = []
            for client in clients:
                assert client.stdout is not None
                line = client.stdout.readline()
                if not line:
                    raise BenchmarkFailed(f"a client process failed (exit {client.wait(60)})")
                times += [tuple(t) for t in json.loads(line)]
            cpu, rss = _proc_stats(coordinator.pid)
            # every worker now heartbeats once a second: what that costs the coordinator
            time.sleep(beat_window)
            beat_cpu, rss = _proc_stats(coordinator.pid)
            for client in clients:
                assert client.stdin is not None
                client.stdin.write("\n")
                client.stdin.flush()
            for client in clients:
                client.wait(timeout=_TIMEOUT)
            coordinator.wait(timeout=60)
            log = (Path(tmp) / "log").read_text().strip().splitlines()
        finally:
            for proc in [*clients, coordinator]:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
    joins = sorted(end - start for start, end in times)
    return {
        "workers": workers,
        "processes": len(clients),
        "rendezvous_s": max(e for _, e in times) - min(s for s, _ in times),
        "join_p50_s": statistics.median(joins),
        "join_p99_s": joins[min(len(joins) - 1, int(0.99 * len(joins)))],
        "coordinator_cpu_s": cpu,
        "heartbeat_cpu_share": (beat_cpu - cpu) / beat_window,
        "coordinator_peak_rss_mib": rss,
        "coordinator_exit": coordinator.returncode,
        "coordinator_last_line": log[-1] if log else "",
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="shardwire bench rendezvous",
        description=__doc__,
        epilog="example:\n  shardwire bench rendezvous --workers 1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, nargs="+", default=[1000])
    p.add_argument("--processes", type=int, default=4, help="client processes")
    p.add_argument("--per-node", type=int, default=8, help="simulated workers per node")
    p.add_argument("--beat-window", type=float, default=5.0, help="seconds of heartbeats")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = []
    print("| workers | rendezvous (s) | join p50 (s) | join p99 (s) | coordinator CPU (s) | "
          "coordinator peak RSS (MiB) | heartbeats (share of a core) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.workers:
        r = measure(n, args.processes, args.per_node, args.beat_window)
        results.append(r)
        print(
            f"| {n} | {r['rendezvous_s']:.2f} | {r['join_p50_s']:.2f} | {r['join_p99_s']:.2f} "
            f"| {r['coordinator_cpu_s']:.2f} | {r['coordinator_peak_rss_mib']:.0f} "
            f"| {r['heartbeat_cpu_share']:.3f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        port, first, count, world, lws = (int(x) for x in sys.argv[2:7])
        asyncio.run(_workers(port, first, count, world, lws))
    else:
        sys.exit(main(sys.argv[1:]))
