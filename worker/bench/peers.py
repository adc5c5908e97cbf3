"""The jobs ``shardwire bench goodput --torch ddp --compare-torchft`` times beside
shardwire's: torch charlm under DDP recovered the ways torch users recover it today, with
the same steps and the same kill schedule (the chaos plan's draws: times from the job's
start, ranks from the seed).

- **torchft**: a lighthouse and one replica group of one process per rank
  (``torchft_replica.py``, run by an interpreter that has torchft); a killed replica is
  started again at once and heals from a live peer while the others train on, as
  ``torchrun --max-restarts`` per replica group would start it.
- **torchrun**: ``torchrun --max-restarts`` over gloo, the example keeping a
  ``torch.distributed.checkpoint`` on disk; a killed worker makes torchrun stop every
  worker and start them all again from the newest checkpoint.

Each run is bounded in time; every process it started is ended by PID before it
returns.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import side_python
from shardwire.worker.bench.torchrun import clean_env, free_port
from shardwire.worker.chaos.plan import Scheduled
from shardwire.worker.launcher.exits import process_state

REPLICA = Path(__file__).with_name("torchft_replica.py")
TORCHFT_VENV = "torchft-venv"  # under ~/.cache: where `make torchft-venv` puts it
POLL_S = 0.05
ENDED_S = 15.0  # how long the end of a run waits for its processes to end


@dataclass
class PeerRun:
    """What one run of a peer's job did: its wall time, whether its steps finished, the
    kills delivered and the worker processes it started; for torchft, whether every
    replica ended with the same parameters (``agree``)."""

    wall_s: float
    finished: bool
    faults: int = 0
    processes: int = 0
    detail: str = ""
    agree: bool | None = None
    pids: set[int] = field(default_factory=set)


def torchft_python(requested: str | None) -> str | None:
    """The interpreter for torchft's replicas: ``requested``, else this one, else
    ``~/.cache/torchft-venv/bin/python``, the first with torchft and shardwire."""
    return side_python(requested, TORCHFT_VENV, "import torchft, shardwire.torch")


def _kill_due(schedule: list[Scheduled], start: float, ranks: dict[int, int]) -> int:
    """SIGKILL the rank of every scheduled kill now due whose rank has a live process;
    return how many were delivered. A due kill of a rank that is down is dropped, as
    the chaos supervisor drops it."""
    delivered = 0
    now = time.monotonic() - start
    while schedule and (schedule[0].at_s or 0.0) <= now:
        due = schedule.pop(0)
        pid = ranks.get(due.rank)
        if pid is None:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            delivered += 1
        except ProcessLookupError:
            pass
    return delivered


def _end(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
    for p in processes:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _lighthouse(python: str, work: Path) -> tuple[subprocess.Popen, int]:
    """torchft's lighthouse on loopback, tuned as a fast recovery wants it (a replica
    missing for 0.5 s is out of the quorum)."""
    binary = Path(python).parent / "torchft_lighthouse"
    port = free_port()
    log = (work / "lighthouse.log").open("wb")
    process = subprocess.Popen(  # noqa: S603 - torchft's own binary beside the interpreter
        [str(binary), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1"]
        + ["--heartbeat_timeout_ms", "500", "--join_timeout_ms", "1000", "--quorum_tick_ms", "100"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return process, port
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(POLL_S)
    _end([process])
    raise BenchmarkFailed(f"torchft's lighthouse did not start (see {work / 'lighthouse.log'})")


def torchft_job(
    python: str,
    flags: list[str],
    *,
    nproc: int,
    work: Path,
    schedule: list[Scheduled],
    timeout: float,
) -> PeerRun:
    """torch charlm with ``flags`` as ``nproc`` torchft replicas, under ``schedule``."""
    work.mkdir(parents=True)
    barrier = work / "barrier"
    barrier.mkdir()
    lighthouse, port = _lighthouse(python, work)
    started: list[subprocess.Popen] = []
    replicas: dict[int, subprocess.Popen] = {}

    def spawn(replica: int) -> None:
        env = clean_env(
            TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}",
            FT_REPLICA=str(replica),
            FT_REPLICAS=str(nproc),
            FT_EXAMPLES=str(Path.cwd() / "examples"),
            FT_OUT=str(work),
            GLOO_SOCKET_IFNAME="lo",
            RUST_LOG="warn",
            FT_BARRIER=str(barrier),  # a replica started again finds the others ready
        )
        log = work / f"replica-{replica}.{len(started)}.log"
        with log.open("wb") as out:
            p = subprocess.Popen(  # noqa: S603 - our replica script
                [python, str(REPLICA), *flags],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        started.append(p)
        replicas[replica] = p

    start = time.monotonic()
    faults, pending = 0, sorted(schedule, key=lambda s: s.at_s or 0.0)
    try:
        for replica in range(nproc):
            spawn(replica)
        while time.monotonic() - start < timeout:
            done = {r for r in range(nproc) if (work / f"replica-{r}.json").exists()}
            if len(done) == nproc:
                break
            for replica, p in list(replicas.items()):
                code = p.poll()
                if code is not None and replica not in done:
                    if code == 0:
                        raise BenchmarkFailed(f"torchft replica {replica} ended without its steps")
                    spawn(replica)  # killed: started again at once
            live = {r: p.pid for r, p in replicas.items() if p.poll() is None and r not in done}
            faults += _kill_due(pending, start, live)
            time.sleep(POLL_S)
        wall = time.monotonic() - start
        finished = all((work / f"replica-{r}.json").exists() for r in range(nproc))
    finally:
        _end([*started, lighthouse])
    run = PeerRun(wall, finished, faults, len(started), pids={p.pid for p in started})
    if finished:
        ends = [json.loads((work / f"replica-{r}.json").read_text()) for r in range(nproc)]
        run.agree = len({end["digest"] for end in ends}) == 1
    return run


def _end_agent(agent: subprocess.Popen) -> list[int]:
    """End torchrun's agent and its workers; return the workers it had. The agent is
    stopped first, so that it starts no worker between the listing and its end (its
    workers run in sessions of their own, so the agent's end would leave them running),
    and the return waits, bounded, until every worker has ended."""
    try:
        os.kill(agent.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + ENDED_S
    while process_state(agent.pid) not in ("T", "Z", "") and time.monotonic() < deadline:
        time.sleep(POLL_S)  # until it has stopped (or ended)
    workers = _children(agent.pid)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _end([agent])
    running = [pid for pid in workers if process_state(pid) not in ("Z", "")]
    while running and time.monotonic() < deadline:
        time.sleep(POLL_S)
        running = [pid for pid in running if process_state(pid) not in ("Z", "")]
    return workers


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def torchrun_job(
    script: Path,
    flags: list[str],
    *,
    nproc: int,
    work: Path,
    schedule: list[Scheduled],
    timeout: float,
) -> PeerRun:
    """``script`` with ``flags`` under ``torchrun --max-restarts`` (gloo, its checkpoint
    on disk), under ``schedule``."""
    work.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1000",
        "--monitor-interval=0.1",
        "--standalone",
        "--local-addr=127.0.0.1",
        str(script),
        "--backend=gloo",
        *flags,
        f"--checkpoint-dir={work / 'checkpoints'}",
        f"--run-dir={work / 'run'}",
    ]
    env = clean_env(GLOO_SOCKET_IFNAME="lo", TORCHELASTIC_ERROR_FILE=str(work / "error.json"))
    seen: set[int] = set()
    start = time.monotonic()
    faults, pending = 0, sorted(schedule, key=lambda s: s.at_s or 0.0)
    with (work / "torchrun.log").open("wb") as log:
        agent = subprocess.Popen(  # noqa: S603 - torch's own launcher
            command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        while agent.poll() is None and time.monotonic() - start < timeout:
            workers = {r: pid for pid in _children(agent.pid) if (r := _rank_of(pid)) is not None}
            seen.update(workers.values())
            faults += _kill_due(pending, start, workers)
            time.sleep(POLL_S)
        wall = time.monotonic() - start
        finished = agent.poll() == 0 and (work / "run" / "summary.json").exists()
    finally:
        seen.update(_end_agent(agent))
    detail = "" if finished else (work / "torchrun.log").read_text(errors="replace")[-3000:]
    return PeerRun(wall, finished, faults, len(seen), detail=detail, pids=seen)
