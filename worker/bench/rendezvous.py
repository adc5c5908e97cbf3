"""``shardwire bench rendezvous``: how fast a coordinator admits a job of N workers.

    shardwire bench rendezvous [--workers 1000] [--processes 4] [--per-node 8]
                               [--beat-window 5] [--direct] [--json OUT]

A real coordinator runs as its own process (``python -m shardwire.coordinator``); the
workers are simulated by ``--processes`` client processes, each running its share of
the nodes in one event loop: a node agent (a real control client that joins for its
node and forwards its workers' heartbeats from its local socket, as ``shardwire
worker`` does), then the node's workers as real control clients: handshake, join,
placement, heartbeats through the agent, then one lookup of the addresses of the peers
a ring and a hypercube connect it to (the neighbours its collectives use). With
``--direct`` there are no agents and every worker heartbeats the coordinator itself (as
under ``srun -n N shardwire run``). Each simulated worker times its own join, from
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


async def _workers(
    port: int, first: int, count: int, world: int, lws: int, *, agents: bool
) -> None:
    """Run workers ``first`` .. ``first + count - 1`` (with their nodes' agents when
    ``agents``: whole nodes) and print when the first dialled and each one's join times
    (the token comes in SHARDWIRE_TOKEN, never on a command line)."""
    from shardwire.protocol import Token
    from shardwire.protocol.messages import Join, NodeJoin
    from shardwire.protocol.nofile import ensure_nofile
    from shardwire.worker.runtime.beats import BeatRelay, NodeBeats
    from shardwire.worker.runtime.control import ControlClient

    token = Token(os.environ["SHARDWIRE_TOKEN"])
    ensure_nofile(4 * count + 256, "the simulated workers", strict=False)  # + agent sockets
    clients = [ControlClient(token=token, run_id="bench", role="worker") for _ in range(count)]
    nodes = range(first // lws, (first + count) // lws) if agents else range(0)
    agent_of = {k: ControlClient(token=token, run_id="bench", role="agent") for k in nodes}
    beats = {k: NodeBeats(agent_of[k].send, interval=1.0) for k in nodes}
    ready: dict[int, asyncio.Task[tuple[int, int, str]]] = {}  # each node's agent, owned
    relays: list[BeatRelay] = []
    first_dial = time.time()

    async def agent(k: int) -> tuple[int, int, str]:
        """As ``shardwire worker``: join for the node, then its processes start."""
        await agent_of[k].connect("127.0.0.1", port, timeout=_TIMEOUT)
        path = await beats[k].start()
        join = NodeJoin(world_size=world, node_id=f"node-{k:06d}", local_world_size=lws,
                        node_index=k)  # fmt: skip
        assignment = await agent_of[k].node_join(join, timeout=_TIMEOUT)
        return assignment.node_rank, assignment.generation, path

    async def one(i: int) -> tuple[float, float]:
        node = (first + i) // lws
        node_rank, generation, path = await ready[node] if agents else (-1, 0, "")
        asked = node_rank * lws + (first + i) % lws if agents else None  # its RANK
        start = time.time()
        client = clients[i]
        await client.connect("127.0.0.1", port, timeout=_TIMEOUT)
        if asked is not None:  # as a worker's control thread: beats through its agent
            relays.append(await BeatRelay.open(path, asked, generation, timeout=60))
            client.relay(relays[-1])
        client.start_heartbeats(1.0)  # from the connection on
        msg = Join(
            world_size=world,
            node_id=f"node-{node:06d}",
            local_rank=(first + i) % lws,
            local_world_size=lws,
            listen_port=10000 + (first + i) % 50000,
            requested_rank=asked,
        )
        place = await client.join(msg, timeout=_TIMEOUT)
        members = await client.peers(neighbours(place.rank, world), timeout=_TIMEOUT)
        done = time.time()
        assert [m.rank for m in members] == neighbours(place.rank, world)
        return start, done

    try:
        for k in nodes:
            ready[k] = asyncio.create_task(agent(k))
        times = await asyncio.gather(*(one(i) for i in range(count)))
        print(json.dumps({"first": first_dial, "joins": times}), flush=True)
        # the driver says when the beat window is over; read off the loop, so the
        # workers keep heartbeating meanwhile (the window measures exactly that)
        await asyncio.to_thread(sys.stdin.readline)
        for client in clients:
            client.leave()
    finally:
        await _end(list(ready.values()), relays, clients, [*beats.values(), *agent_of.values()])


async def _end(agents: list, relays: list, clients: list, nodes: list) -> None:
    """Close what a client process made: its agents' tasks (done unless a worker failed
    first), the workers' connections (their heartbeats stop), their relays, then the
    agents' sockets and connections."""
    for task in agents:
        task.cancel()
    await asyncio.gather(*agents, return_exceptions=True)
    for client in clients:
        await client.aclose()
    for relay in relays:
        relay.close()
    for node in nodes:
        await node.aclose()


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


def measure(
    workers: int, processes: int, lws: int, beat_window: float = 5.0, *, agents: bool = True
) -> dict:
    """One run: a coordinator and ``processes`` client processes for ``workers`` (with an
    agent per node that batches its workers' heartbeats, unless ``agents`` is False);
    then ``beat_window`` seconds of every worker heartbeating."""
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
            share = -(-workers // lws // processes) * lws  # whole nodes per process
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
                            "agents" if agents else "direct",
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                        env=env,
                    )  # fmt: skip
                )
            times: list[tuple[float, float]] = []
            firsts: list[float] = []
            for client in clients:
                assert client.stdout is not None
                line = client.stdout.readline()
                if not line:
                    raise BenchmarkFailed(f"a client process failed (exit {client.wait(60)})")
                report = json.loads(line)
                firsts.append(report["first"])
                times += [tuple(t) for t in report["joins"]]
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
            if coordinator.returncode != 0:  # figures of a failed job would mislead
                last = log[-1] if log else "no log"
                raise BenchmarkFailed(f"the job failed ({coordinator.returncode}): {last}")
        finally:
            for proc in [*clients, coordinator]:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
    joins = sorted(end - start for start, end in times)
    return {
        "workers": workers,
        "processes": len(clients),
        "agents": agents,
        # from the first dial (an agent's, where they run) to the last worker placed
        "rendezvous_s": max(e for _, e in times) - min([*firsts, *(s for s, _ in times)]),
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
    p.add_argument(
        "--processes",
        type=int,
        default=4,
        help="client processes (one that simulates too many workers for its share of the "
        "CPUs delays their heartbeats past the coordinator's limit: the job then fails, as "
        "it should, and so does the run; 4 carry 10,000 workers on 2 cores)",
    )
    p.add_argument("--per-node", type=int, default=8, help="simulated workers per node")
    p.add_argument("--beat-window", type=float, default=5.0, help="seconds of heartbeats")
    p.add_argument(
        "--direct",
        action="store_true",
        help="no node agents: every worker heartbeats the coordinator itself (as under "
        "srun -n N shardwire run); by default an agent per node batches them",
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    results = []
    print("| workers | rendezvous (s) | join p50 (s) | join p99 (s) | coordinator CPU (s) | "
          "coordinator peak RSS (MiB) | heartbeats (share of a core) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n in args.workers:
        r = measure(n, args.processes, args.per_node, args.beat_window, agents=not args.direct)
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
        import uvloop

        port, first, count, world, lws = (int(x) for x in sys.argv[2:7])
        # uvloop: the simulated workers' own I/O is not what is measured, and on a small
        # machine they share the cores with the coordinator
        uvloop.run(_workers(port, first, count, world, lws, agents=sys.argv[7] == "agents"))
    else:
        sys.exit(main(sys.argv[1:]))
