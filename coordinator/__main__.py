"""``python -m shardwire.coordinator``: the rendezvous service (composition root)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from shardwire.coordinator.etcd import EtcdClient
from shardwire.coordinator.http import StatusHTTP
from shardwire.coordinator.journal import JournalStore, StateDir
from shardwire.coordinator.leadership import EtcdJournal, Leadership
from shardwire.coordinator.respawn import respawn
from shardwire.coordinator.server import CoordinatorServer, ServerConfig
from shardwire.coordinator.settings import CoordinatorSettings
from shardwire.coordinator.state import JobState, RendezvousConfig
from shardwire.coordinator.tls import server_context
from shardwire.coordinator.views import status_reply
from shardwire.protocol import InvalidArgument, ShardwireError, Token
from shardwire.protocol.auth import check_bind, load_token
from shardwire.protocol.history import parse_nnodes
from shardwire.protocol.nofile import ensure_nofile

# Time for the abort broadcast to reach every survivor before the listener goes away.
_LINGER = 1.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire coordinator",
        description="Rendezvous, rank assignment and liveness for one job. "
        "Every flag can also be set as SHARDWIRE_<FLAG>.",
        epilog="examples:\n"
        "  shardwire coordinator --world-size 8 --token-file token\n"
        "  shardwire coordinator --host 0.0.0.0 --nnodes 2:4 --token-file token",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind, 0 for any (default 29400)")
    p.add_argument("--world-size", type=int, help="total worker processes (default: from joiners)")
    p.add_argument("--run-id", help="job identifier every joiner must present")
    p.add_argument("--token-file", help="file holding the shared token (or SHARDWIRE_TOKEN)")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback bind without a token",
    )
    p.add_argument("--join-timeout", type=float, help="seconds to wait for the world (300)")
    p.add_argument("--heartbeat-timeout", type=float, help="silence that marks a worker dead (5)")
    p.add_argument(
        "--diagnose-timeout",
        type=float,
        help="seconds a hang's inquest waits for every rank's answer (3)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        help="failures the job recovers from, at most: each ends its generation and the "
        "next forms (default: the agents' --max-restarts)",
    )
    p.add_argument("--nnodes", help="MIN:MAX node agents for an elastic job (default: the agents')")
    p.add_argument(
        "--last-call",
        type=float,
        help="seconds more nodes may join once MIN are in (3)",
    )
    p.add_argument(
        "--inquest-dir",
        help="where a hang's inquest writes every rank's place, stack and recent collectives "
        "(the verdict names the file; default ./inquests, '' for nowhere)",
    )
    p.add_argument("--port-file", help="write the bound port here once listening")
    p.add_argument("--http-host", help="address of the status page and /metrics (127.0.0.1)")
    p.add_argument("--http-port", type=int, help="its port (29480; 0 any, -1 none)")
    p.add_argument("--log-level", help="logging level (INFO)")
    p.add_argument("--tls-cert", help="PEM certificate: TLS with mutual authentication")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that signs every member's certificate")
    p.add_argument(
        "--state-dir",
        help="journal the running generation here; a coordinator restarted on it (same "
        "address) resumes the job while its ranks keep training (default: none)",
    )
    p.add_argument(
        "--coordinator-grace",
        type=float,
        help="with --state-dir or --etcd: how long ranks wait for a coordinator that went "
        "away, and a restarted one for them (60)",
    )
    p.add_argument(
        "--respawn",
        type=int,
        help="with --state-dir and a --port: start the coordinator again there whenever a "
        "signal kills it (the OOM killer, a kill), at most this many times (0)",
    )
    p.add_argument(
        "--etcd",
        help="ENDPOINT[,ENDPOINT...]: run as one of the job's coordinator replicas, which "
        "elect a leader and keep its journal in this etcd cluster (default: none)",
    )
    p.add_argument(
        "--etcd-ttl",
        type=int,
        help="seconds a leader's etcd lease outlives its last renewal: how soon a standby "
        "takes over from a leader that died (2)",
    )
    return p


def settings_from(argv: list[str] | None) -> CoordinatorSettings:
    args = vars(parser().parse_args(argv))
    settings = CoordinatorSettings(**{k: v for k, v in args.items() if v is not None})
    if settings.nnodes:
        parse_nnodes(settings.nnodes)  # a malformed range is refused at start (ValueError)
    if settings.etcd and settings.state_dir:
        raise InvalidArgument(
            "give --state-dir or --etcd, not both: with etcd the journal is there"
        )
    if settings.respawn and (not settings.state_dir or settings.port == 0):
        raise InvalidArgument(
            "--respawn needs --state-dir and a --port: a coordinator started again resumes "
            "the job from its journal, where the ranks dial it"
        )
    if settings.etcd and settings.port == 0:
        raise InvalidArgument("a replica (--etcd) needs a --port of its own: workers dial each one")
    return settings


def http_port_chosen(settings: CoordinatorSettings) -> bool:
    """Whether the status page's port was given (flag or environment): taken, it is an
    error; the default's taken (another coordinator on the host) gives way to a free one."""
    return "http_port" in settings.model_fields_set


def rendezvous_config(settings: CoordinatorSettings) -> RendezvousConfig:
    return RendezvousConfig(
        run_id=settings.run_id,
        world_size=settings.world_size,
        join_timeout=settings.join_timeout,
        heartbeat_timeout=settings.heartbeat_timeout,
        diagnose_timeout=settings.diagnose_timeout,
        max_restarts=settings.max_restarts,
        min_nodes=parse_nnodes(settings.nnodes)[0] if settings.nnodes else None,
        last_call=settings.last_call,
        inquest_dir=str(Path(settings.inquest_dir).absolute()) if settings.inquest_dir else None,
        grace=settings.coordinator_grace if settings.state_dir or settings.etcd else 0.0,
    )


def _write_port_file(path: str, port: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(f"{port}\n")
    os.replace(tmp, path)  # readers never see a half-written file


async def serve(settings: CoordinatorSettings) -> int:
    token = load_token(
        settings.token.get_secret_value() if settings.token else None, settings.token_file
    )
    check_bind(settings.host, token, insecure=settings.insecure, what="coordinator")
    if settings.etcd:
        return await _replica(settings, token)
    state = None
    if settings.state_dir:  # refused at once if unusable, held by another, or another run's
        state = StateDir(settings.state_dir, settings.run_id)
        state.open()
    try:
        return await _serve(settings, token, state)
    finally:
        if state is not None:
            state.close()


async def _replica(settings: CoordinatorSettings, token: Token) -> int:
    """One of the job's coordinator replicas: a standby until it leads, then the
    coordinator, its journal in etcd, until the job ends or another replica leads."""
    assert settings.etcd is not None
    client = EtcdClient([e.strip() for e in settings.etcd.split(",") if e.strip()])
    me = f"{settings.host}:{settings.port} (PID {os.getpid()} on {socket.gethostname()})"
    leadership = Leadership(client, settings.run_id, me, ttl=settings.etcd_ttl)
    term = await leadership.campaign(_say)
    if isinstance(term, str):  # the job ended under another replica
        _say(f"run {settings.run_id!r} {term} under another replica")
        return 0 if term == "finished" else 1
    _say(f"leading run {settings.run_id!r} (epoch {term.epoch})")
    return await _serve(settings, token, EtcdJournal(leadership, settings.run_id), leadership)


def _say(line: str) -> None:
    print(f"shardwire coordinator: {line}", file=sys.stderr, flush=True)


async def _serve(
    settings: CoordinatorSettings,
    token: Token,
    state: JournalStore | None,
    leadership: Leadership | None = None,
) -> int:
    config = ServerConfig(
        rendezvous_config(settings),
        tls=server_context(settings.tls_cert, settings.tls_key, settings.tls_ca),
        state=state,
        epoch=leadership.term.epoch if leadership and leadership.term else 0,
    )
    # a connection per worker, then room for node agents, handshakes (512 at most) and
    # the status page's (the soft limit goes to the hard one anyway); an elastic job's
    # size is not known: as many as the hard limit allows
    workers = settings.world_size or 1024
    ensure_nofile(
        workers + 1024,
        f"the coordinator of a {workers}-rank job",
        strict=settings.world_size is not None,
    )
    server = CoordinatorServer(config, token)
    http = StatusHTTP(server.rendezvous)
    keeper = None
    try:
        host, port = await server.start(settings.host, settings.port)
        if leadership is not None:  # owned here: stopped below
            keeper = leadership.hold(server.depose)
        if settings.port_file:
            _write_port_file(settings.port_file, port)
        print(f"shardwire coordinator listening on {host}:{port}", file=sys.stderr, flush=True)
        if server.restored:  # after the first line, which launchers read for the address
            print(server.restored, file=sys.stderr, flush=True)
        if settings.http_port >= 0:
            http_host, http_port = await http.start(
                settings.http_host, settings.http_port, free_if_taken=not http_port_chosen(settings)
            )
            print(f"status page on http://{http_host}:{http_port}/", file=sys.stderr, flush=True)
        await server.done.wait()
        if not server.deposed:
            await asyncio.sleep(_LINGER)
    finally:
        if keeper is not None:
            await asyncio.to_thread(keeper.stop)
        await http.aclose()
        await server.aclose()
    if server.deposed:
        _say(f"deposed: {server.deposed}")
        return 3
    server.rendezvous.links.links()  # the closing lines read every report, however late
    last = status_reply(server.rendezvous, time.monotonic(), limit=0)
    if last.straggler:  # who the others waited for, over the job's last collectives
        print(f"straggler: {last.straggler}", file=sys.stderr, flush=True)
    if last.slow_link:  # the link far slower than the others
        print(f"slow link: {last.slow_link}", file=sys.stderr, flush=True)
    failure = server.rendezvous.failure
    finished = server.rendezvous.state is JobState.FINISHED
    if failure is not None and server.rendezvous.state is JobState.FAILED:
        print(f"job failed: rank {failure.rank}: {failure.reason}", file=sys.stderr)
        if failure.stacks:
            print(failure.stacks.rstrip(), file=sys.stderr)
    if leadership is not None:  # the standbys end with the job
        await leadership.conclude("finished" if finished else "failed")
    return 0 if finished else 1


def _run(main: Coroutine[Any, Any, int]) -> int:
    """On uvloop when installed (measured: a 4,000-worker rendezvous took a third less
    coordinator CPU), else the stock loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from(argv)
    except ValueError as exc:
        print(f"shardwire coordinator: {exc}", file=sys.stderr)
        return 2
    if settings.respawn:
        return respawn(sys.argv[1:] if argv is None else argv, settings.respawn)
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    try:
        return _run(serve(settings))
    except ShardwireError as exc:
        print(f"shardwire coordinator: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
