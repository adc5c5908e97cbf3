"""``shardwire bench rendezvous``: how fast a coordinator admits a job of N workers.

    shardwire bench rendezvous [--workers 1000] [--processes 4] [--per-node 8]
                               [--beat-window 5] [--direct] [--reform | --restart]
                               [--etcd ENDPOINT] [--json OUT]

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
* ``coordinator_peak_rss_mib``: its peak resident memory (``VmHWM``);
* ``reform_s`` (``--reform``): one worker's connection closes (its process died); every
  other worker leaves generation 1 and joins the next with its rank on a new connection,
  as ``Session.reform`` does, the agents join again, and the failed worker's replacement
  joins: the seconds from the failure to the last worker holding its peers' addresses.
* ``restart_s`` (``--restart``): the coordinator (given a state directory) is SIGKILLed
  and started again on its journal and port: the seconds from the kill to the last
  worker and agent taken back (the coordinator watching every rank again), with
  ``coordinator_up_s``, the kill to the new coordinator listening.
* ``etcd_writes_forming`` / ``etcd_put_bytes_forming`` / ``etcd_writes_per_s_running``
  (``--etcd ENDPOINT``: the coordinator runs as a replica keeping its journal in that
  etcd): the writes (etcd revisions) and bytes put from its start to the last worker
  placed, and the writes per second while every worker heartbeats (etcd's own
  ``/metrics``).

Nothing here asserts a speed: the figures are for comparing runs on one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import coordinator_port
from shardwire.worker.bench.stages import Stages
from shardwire.worker.bench.torchrun import free_port
from shardwire.worker.kernels.procstat import stat_fields

_TIMEOUT = 600.0  # seconds for the whole run (every wait below is bounded by it)


def _proc_stats(pid: int) -> tuple[float, float]:
    """(CPU seconds, peak RSS MiB) of process ``pid`` so far."""
    fields = stat_fields(pid)
    if fields is None:
        raise BenchmarkFailed(f"process {pid} ended before its CPU time was read")
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return cpu, hwm


def measure(
    workers: int,
    processes: int,
    lws: int,
    beat_window: float = 5.0,
    *,
    agents: bool = True,
    reform: bool = False,
    restart: bool = False,
    etcd: str | None = None,
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

        def start(port: int) -> subprocess.Popen:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shardwire.coordinator",
                    "--port",
                    str(port),
                    "--port-file",
                    str(port_file),
                    "--world-size",
                    str(workers),
                    "--run-id",
                    "bench",
                    "--http-port",
                    "-1",
                    "--log-level",
                    "WARNING",
                    *(["--max-restarts", "1"] if reform else []),
                    *(["--state-dir", str(Path(tmp) / "state")] if restart else []),
                    *(["--etcd", etcd] if etcd else []),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(Path(tmp) / "log").open("a"),
            )

        before = etcd_counts(etcd)
        coordinator = start(free_port() if etcd else 0)  # a replica's port is its own
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
                    )
                )
            times: list[tuple[float, float]] = []
            firsts: list[float] = []
            for client in clients:
                report = _report(client)
                firsts.append(report["first"])
                times += [tuple(t) for t in report["joins"]]
            cpu, rss = _proc_stats(coordinator.pid)
            formed = etcd_counts(etcd)
            # every worker now heartbeats once a second: what that costs the coordinator
            time.sleep(beat_window)
            beat_cpu, rss = _proc_stats(coordinator.pid)
            beating = etcd_counts(etcd)
            reform_s = restart_s = up_s = None
            if reform:
                reform_s = _reform(clients)
            if restart:
                coordinator, restart_s, up_s = _restart(clients, coordinator, start, port_file)
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
        "reform_s": reform_s,
        "restart_s": restart_s,
        "coordinator_up_s": up_s,
        "etcd_writes_forming": formed[0] - before[0] if etcd else None,
        "etcd_put_bytes_forming": formed[1] - before[1] if etcd else None,
        "etcd_writes_per_s_running": (beating[0] - formed[0]) / beat_window if etcd else None,
        "coordinator_exit": coordinator.returncode,
        "coordinator_last_line": log[-1] if log else "",
    }


def etcd_counts(endpoint: str | None) -> tuple[int, int]:
    """(revision, bytes put) of the etcd at ``endpoint`` (its ``/metrics``); (0, 0)
    without one. Its revision grows by one for each write it commits."""
    if not endpoint:
        return 0, 0
    url = (endpoint if "://" in endpoint else f"http://{endpoint}").rstrip("/") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 (the user's etcd)
        text = reply.read().decode()
    found = dict.fromkeys(_ETCD_METRICS, 0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in found:
            found[name] = int(float(value))
    return found[_ETCD_METRICS[0]], found[_ETCD_METRICS[1]]


_ETCD_METRICS = (
    "etcd_debugging_mvcc_current_revision",
    "etcd_debugging_mvcc_total_put_size_in_bytes",
)


def _report(client: subprocess.Popen) -> dict:
    """A client process's next JSON line (its figures)."""
    assert client.stdout is not None
    line = client.stdout.readline()
    if not line:
        raise BenchmarkFailed(f"a client process failed (exit {client.wait(60)})")
    return json.loads(line)


def _reform(clients: list[subprocess.Popen]) -> float:
    """Live re-formation: one worker fails, the others re-form in their processes and
    its replacement joins; the seconds from the failure to the last worker holding its
    peers' addresses in the next generation."""
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("reform\n")
        client.stdin.flush()
    failed, placed = [], []
    for client in clients:
        report = _report(client)
        failed.append(report["failed"])
        placed += report["placed"]
    return max(placed) - min(failed)


def _restart(
    clients: list[subprocess.Popen],
    coordinator: subprocess.Popen,
    start: Callable[[int], subprocess.Popen],
    port_file: Path,
) -> tuple[subprocess.Popen, float, float]:
    """SIGKILL the coordinator and start it again on its journal and port: the new one,
    the seconds to every worker and agent back, and to the new one listening."""
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("restart\n")
        client.stdin.flush()
    for client in clients:
        _report(client)  # ready: watching for the coordinator to go away
    port = int(port_file.read_text())
    killed = time.time()
    coordinator.kill()
    coordinator.wait(timeout=60)
    port_file.unlink()
    again = start(port)
    coordinator_port(port_file, again)
    up = time.time() - killed
    back = [t for client in clients for t in _report(client)["back"]]
    return again, max(back) - killed, up


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench rendezvous``."""
    p = argparse.ArgumentParser(
        prog="shardwire bench rendezvous",
        description=__doc__,
        epilog="example:\n  shardwire bench rendezvous --workers 1000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1000],
        help="simulated workers of a job (a multiple of --per-node), one job and table row "
        "per value (1000)",
    )
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
    p.add_argument(
        "--reform",
        action="store_true",
        help="then one worker fails and the others re-form in their processes (live "
        "recovery) while its replacement joins: the seconds to the next generation formed",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="then the coordinator (with a state directory) is SIGKILLed and started again "
        "on its journal: the seconds to every worker and agent taken back",
    )
    p.add_argument(
        "--etcd",
        help="ENDPOINT of a running etcd: the coordinator runs as a replica keeping its "
        "journal there, and the etcd writes it makes are counted",
    )
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.reform and args.restart:
        p.error("--reform and --restart are separate runs: give one")
    results = []
    print(
        "| workers | rendezvous (s) | join p50 (s) | join p99 (s) | coordinator CPU (s) | "
        "coordinator peak RSS (MiB) | heartbeats (share of a core) |"
    )
    print("|---|---|---|---|---|---|---|", flush=True)
    # forming a job takes about as long as it has workers: they are its stage's work
    progress = Stages("rendezvous", len(args.workers), work=sum(args.workers))
    for n in args.workers:
        progress.start(f"a job of {n} workers", work=n)
        r = measure(
            n,
            args.processes,
            args.per_node,
            args.beat_window,
            agents=not args.direct,
            reform=args.reform,
            restart=args.restart,
            etcd=args.etcd,
        )
        results.append(r)
        print(
            f"| {n} | {r['rendezvous_s']:.2f} | {r['join_p50_s']:.2f} | {r['join_p99_s']:.2f} "
            f"| {r['coordinator_cpu_s']:.2f} | {r['coordinator_peak_rss_mib']:.0f} "
            f"| {r['heartbeat_cpu_share']:.3f} |",
            flush=True,
        )
        if r["reform_s"] is not None:
            print(
                f"  one worker failed; the next generation formed in process in "
                f"{r['reform_s']:.2f} s",
                flush=True,
            )
        if r["etcd_writes_forming"] is not None:
            print(
                f"  etcd: {r['etcd_writes_forming']} writes ({r['etcd_put_bytes_forming']} "
                f"bytes put) to form the job, then {r['etcd_writes_per_s_running']:.2f} "
                "writes/s while every worker heartbeats",
                flush=True,
            )
        if r["restart_s"] is not None:
            print(
                f"  coordinator SIGKILLed and started again: listening after "
                f"{r['coordinator_up_s']:.2f} s, every worker and agent back after "
                f"{r['restart_s']:.2f} s",
                flush=True,
            )
    progress.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        import uvloop

        port, first, count, world, lws = (int(x) for x in sys.argv[2:7])
        # uvloop: the simulated workers' own I/O is not what is measured, and on a small
        # machine they share the cores with the coordinator
        from shardwire.worker.bench.simulated import Simulated

        # a line for each of its clients that took a restarted coordinator back would
        # bury the figures
        logging.getLogger("shardwire.worker").setLevel(logging.ERROR)
        simulated = Simulated(port, first, count, world, lws, agents=sys.argv[7] == "agents")
        uvloop.run(simulated.run())
    else:
        sys.exit(main(sys.argv[1:]))
