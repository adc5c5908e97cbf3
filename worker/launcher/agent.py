"""The node agent behind ``shardwire worker`` and ``shardwire launch``.

The agent joins the coordinator for its node (``NodeJoin``), learns its node rank, and
only then starts its processes, so each child has ``RANK`` from the start (torchrun's
contract). It stays connected: an abort from the coordinator is echoed in the summary, and its
workers' heartbeats reach the coordinator through it, one message a second for the
node (``worker/runtime/beats.py``).
For ``--standalone`` it first starts a coordinator subprocess on 127.0.0.1 with a fresh
random token.

Generations: when the coordinator answers a failure (or a membership change) with
``Restart``, the agent stops its processes (SIGTERM, SIGKILL after ``--term-timeout``),
removes what they left in shared memory, and sends ``NodeJoin`` again; that tells the
coordinator this node's old processes are gone. The next assignment starts them again
with ``SHARDWIRE_GENERATION`` set, and the script resumes from its latest checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from shardwire.protocol import ShardwireError
from shardwire.protocol.auth import load_token, read_token_file
from shardwire.protocol.messages import NodeAssignment, NodeJoin, Restart
from shardwire.worker.chaos.faultlog import chaos_env
from shardwire.worker.chaos.supervise import node_faults
from shardwire.worker.launcher.cluster import node_place
from shardwire.worker.launcher.forking import ForkServer, server_command
from shardwire.worker.launcher.generations import JobWatch
from shardwire.worker.launcher.hosted import coordinator_command, own_coordinator
from shardwire.worker.launcher.jobcard import cards_dir, publish, withdraw
from shardwire.worker.launcher.options import LaunchSettings, with_scheduler
from shardwire.worker.launcher.supervisor import Launch, Supervisor, thread_defaults
from shardwire.worker.runtime.beats import NodeBeats
from shardwire.worker.runtime.control import ControlClient
from shardwire.worker.runtime.tls import TlsFiles
from shardwire.worker.transport import shm

# How long a node whose processes failed waits for the coordinator's verdict (restart or
# abort); it normally comes within a heartbeat.
_VERDICT_TIMEOUT = 60.0


def token_env(settings: LaunchSettings) -> dict[str, str]:
    token = settings.token.get_secret_value() if settings.token else None
    if not token and settings.token_file:
        token = read_token_file(settings.token_file)
    return {"SHARDWIRE_TOKEN": token} if token else {}


async def run_node(settings: LaunchSettings, argv: list[str]) -> int:
    """Join as this node's agent, run the processes, and report how they ended."""
    serve = False
    if not settings.standalone:  # under a scheduler: what it says, where the user did not
        settings, serve = with_scheduler(settings, node_place(os.environ), os.environ)
    settings.peer_ports()  # a malformed or too small range is refused before anything starts
    env = token_env(settings)
    if settings.chaos:  # checked before anything starts; the ranks and launcher inject it
        env.update(chaos_env(settings.chaos, os.environ))
    tls = settings.tls_files()
    if tls is not None:  # the coordinator and the workers read the files from there
        env.update(tls.env())
    if settings.standalone:
        # A fresh random token unless the user gave one: any local process could join or
        # read a job that has none. It reaches the coordinator and the workers through
        # their environment, never a command line.
        env.setdefault("SHARDWIRE_TOKEN", secrets.token_hex(32))
        async with own_coordinator(coordinator_command(settings), env) as address:
            with _card(settings.run_id, address, env["SHARDWIRE_TOKEN"]):
                return await _agent(settings, argv, address, env)
    address = settings.coordinator_address()
    if serve:  # the job's coordinator, on this first node; everyone dials it by name
        async with own_coordinator(coordinator_command(settings, serve=True), env):
            return await _agent(settings, argv, address, env)
    return await _agent(settings, argv, address, env)


@contextlib.contextmanager
def _card(run_id: str, address: tuple[str, int], token: str) -> Iterator[None]:
    """A standalone job's card for ``shardwire status`` (``jobcard.py``) while it runs."""
    directory = cards_dir(os.environ)
    try:
        card = publish(directory, run_id, f"{address[0]}:{address[1]}", token)
    except (OSError, ShardwireError) as exc:
        print(f"[launch]: no card for shardwire status: {exc}", file=sys.stderr, flush=True)
        yield
        return
    print(
        f"[launch]: shardwire status --run-id {run_id} shows this job (token in {card.token_file})",
        file=sys.stderr,
        flush=True,
    )
    try:
        yield
    finally:
        withdraw(directory, card)


def worker_env(
    settings: LaunchSettings, address: tuple[str, int], env: dict[str, str]
) -> dict[str, str]:
    """A worker process's environment: this process's, ``env``, and the job's."""
    return {**os.environ, **env, **job_env(settings, address)}


def job_env(settings: LaunchSettings, address: tuple[str, int]) -> dict[str, str]:
    """The variables that tell a rank's session which job it joins, at ``address`` (the
    coordinator), and how (every rank's the same)."""
    child_env = {
        "MASTER_ADDR": address[0],
        "MASTER_PORT": str(address[1]),
        "SHARDWIRE_RUN_ID": settings.run_id,
        "SHARDWIRE_JOIN_TIMEOUT": str(settings.join_timeout),
        "SHARDWIRE_STALL_WARN": str(settings.stall_warn),
        "SHARDWIRE_RECOVERY": settings.recovery,
        # rank 0 draws a progress bar only when the person at the terminal sees it
        "SHARDWIRE_INTERACTIVE": "1" if sys.stdout.isatty() else "0",
    }
    if replicas := settings.coordinator_replicas():
        child_env["SHARDWIRE_COORDINATOR_REPLICAS"] = ",".join(f"{h}:{p}" for h, p in replicas)
    if settings.bind_host:
        child_env["SHARDWIRE_BIND_HOST"] = settings.bind_host
    if ports := settings.peer_ports():
        child_env["SHARDWIRE_PEER_PORT_RANGE"] = f"{ports[0]}-{ports[1]}"
    if settings.advertise_host:
        child_env["SHARDWIRE_ADVERTISE_HOST"] = settings.advertise_host
    if settings.insecure:
        child_env["SHARDWIRE_INSECURE"] = "1"
    if settings.trace:
        where = Path(settings.trace_dir or Path("traces") / settings.run_id)
        child_env["SHARDWIRE_TRACE"] = "1"
        child_env["SHARDWIRE_TRACE_DIR"] = str(where.absolute())
    return child_env


async def _agent(
    settings: LaunchSettings, argv: list[str], address: tuple[str, int], env: dict[str, str]
) -> int:
    node_id = settings.node_id or socket.gethostname()
    watch = JobWatch(f"{address[0]}:{address[1]}")
    token = load_token(env.get("SHARDWIRE_TOKEN"), None)
    tls = TlsFiles.from_env(env)
    control = ControlClient(
        token=token,
        run_id=settings.run_id,
        role="agent",
        on_abort=watch.on_abort,
        on_generation=watch.on_generation,
        tls=tls.client_context() if tls else None,
    )
    low, high = settings.node_range
    nproc = settings.nproc_per_node
    join = NodeJoin(
        world_size=high * nproc if not settings.standalone else nproc,
        node_id=node_id,
        local_world_size=nproc,
        min_nodes=low if low < high else 0,
        max_restarts=settings.max_restarts,
        node_index=settings.node_rank,
    )
    child_env = worker_env(settings, address, env)
    forks = _fork_server(argv, child_env) if settings.fork_ranks else None
    beats = NodeBeats(control.send, interval=1.0)  # also this agent's own keepalive
    code = 1
    supervisor: Supervisor | None = None
    chaos: asyncio.Task[None] | None = None  # a plan's faults on this node, if any

    def pids() -> list[int]:
        return [] if supervisor is None else supervisor.pids()

    try:
        await control.connect(
            *address, timeout=settings.join_timeout, replicas=settings.coordinator_replicas()
        )
        child_env["SHARDWIRE_AGENT_BEATS"] = await beats.start()
        while True:
            assignment = await control.node_join(join, timeout=settings.join_timeout)
            launch = _launch(settings, argv, child_env, node_id, assignment)
            supervisor = watch.begin(assignment, launch, forks)
            if chaos is None:
                ranks = [assignment.node_rank * nproc + i for i in range(nproc)]
                chaos = node_faults({**os.environ, **env}, assignment.node_rank, ranks, pids)
            try:
                if launch.respawns:
                    code = await supervise_live(supervisor, watch, control, join, settings)
                    break
                code = await _supervise(supervisor)
            finally:  # the workers are gone: remove the segments a killed one left named
                if swept := shm.sweep(settings.run_id):
                    print(
                        f"[agent]: removed {swept} shared-memory segment(s) left by workers",
                        file=sys.stderr,
                        flush=True,
                    )
            if supervisor.interrupted_by or not watch.may_restart(elastic=low < high):
                break
            timeout = settings.join_timeout if code == 0 else _VERDICT_TIMEOUT
            if not await watch.restarting(timeout):
                break
            print(f"[agent]: {watch.restart_line()}", file=sys.stderr, flush=True)
    finally:
        await _wind_down(chaos, beats, control, forks)
    code = watch.exit_code(code)
    report = watch.report(code)
    if report:
        print(report, file=sys.stderr, flush=True)
    return code


async def _wind_down(
    chaos: asyncio.Task[None] | None,
    beats: NodeBeats,
    control: ControlClient,
    forks: ForkServer | None,
) -> None:
    """Stop what the agent ran beside its ranks, once they have ended."""
    if chaos is not None:
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)
    await beats.aclose()
    await control.aclose()
    if forks is not None:
        await forks.aclose()


def _fork_server(argv: list[str], env: dict[str, str]) -> ForkServer:
    """The node's fork server, started now (its imports run while the node joins): the
    ranks' command line is ``argv``."""
    forks = ForkServer(server_command(argv), {**thread_defaults(env), **env}, err=sys.stderr)
    forks.start()
    return forks


def _launch(
    settings: LaunchSettings,
    argv: list[str],
    env: dict[str, str],
    node_id: str,
    assignment: NodeAssignment,
) -> Launch:
    return Launch(
        argv=argv,
        env=env,
        node_id=node_id,
        node_rank=assignment.node_rank,
        nproc=settings.nproc_per_node,
        world_size=assignment.world_size,
        term_timeout=settings.term_timeout,
        leave_timeout=settings.leave_timeout,
        generation=assignment.generation,
        respawns=settings.max_restarts if settings.recovery == "live" else 0,
    )


async def supervise_live(
    supervisor: Supervisor,
    watch: JobWatch,
    control: ControlClient,
    join: NodeJoin,
    settings: LaunchSettings,
) -> int:
    """Live recovery: one supervisor for the whole job. A dead rank's process is started
    anew by the supervisor; on each ``Restart`` this agent joins the next generation at
    once, its running processes re-forming into it, until the job finishes or fails, or
    this agent was told to stop."""
    run = asyncio.ensure_future(_supervise(supervisor))
    try:
        while True:
            heard = asyncio.ensure_future(watch.heard())
            await asyncio.wait({run, heard}, return_when=asyncio.FIRST_COMPLETED)
            if run.done() or not isinstance(watch.verdict, Restart):
                heard.cancel()
                return await run  # finished, or failed for good: the processes end
            if supervisor.interrupted_by:
                # told to go (SIGTERM: a notice): this node takes no part in the next
                # generation; its ranks finish leaving, and its connection's close tells
                # the coordinator it is gone
                return await run
            print(f"[agent]: {watch.restart_line()}", file=sys.stderr, flush=True)
            watch.renew(await control.node_join(join, timeout=settings.join_timeout))
    finally:
        if not run.done():  # the coordinator could not be joined again: the node stops
            await supervisor.stop()
            await asyncio.gather(run, return_exceptions=True)


def stop_grace(launch: Launch, sig: int) -> float | None:
    """The seconds this node's ranks get after the agent passes ``sig`` on to them, before
    SIGKILL (None: ``--term-timeout``'s). Under live recovery SIGTERM is a notice (a spot
    machine's, say): the ranks hand their state over at their next copy step and leave,
    which may take longer, so they get ``--leave-timeout``'s."""
    if sig == signal.SIGTERM and launch.respawns > 0:
        return max(launch.leave_timeout, launch.term_timeout)
    return None


async def _supervise(supervisor: Supervisor) -> int:
    loop = asyncio.get_running_loop()
    stop_tasks: set[asyncio.Task[None]] = set()
    received: list[int] = []

    def forward(sig: int) -> None:
        received.append(sig)
        supervisor.interrupted_by = supervisor.interrupted_by or sig
        task = asyncio.ensure_future(supervisor.stop(sig, grace=stop_grace(supervisor.launch, sig)))
        stop_tasks.add(task)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, forward, sig)
    try:
        code = await supervisor.run()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in stop_tasks:
            await task
    return 128 + received[0] if received else code
