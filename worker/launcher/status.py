"""``shardwire status``: ask a running coordinator for the job state and print it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from shardwire.protocol.auth import load_token
from shardwire.protocol.history import describe
from shardwire.protocol.messages import StatusReply
from shardwire.worker.launcher.jobcard import cards_dir, lookup
from shardwire.worker.launcher.options import StatusSettings
from shardwire.worker.runtime.control import ControlClient
from shardwire.worker.runtime.loop import run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire status",
        description=__doc__,
        epilog="examples:\n"
        "  shardwire status --coordinator 10.0.0.1:29400 --run-id job1 --token-file token\n"
        "  shardwire status                  the standalone job of run id shardwire here\n"
        "  shardwire status --json | jq .ranks\n"
        "Every flag can also be given as SHARDWIRE_<FLAG> (SHARDWIRE_TOKEN for the\n"
        "token; SHARDWIRE_STATUS_TIMEOUT for --timeout).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--coordinator", help="HOST:PORT (127.0.0.1:29400)")
    p.add_argument("--run-id", help="job identifier (shardwire)")
    p.add_argument("--token-file", help="file with the shared token (or SHARDWIRE_TOKEN)")
    p.add_argument("--tls-cert", help="PEM certificate when the coordinator uses TLS")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that signs the job's certificates")
    p.add_argument(
        "--json",
        dest="json_output",
        action="store_true",
        default=None,
        help="print the coordinator's status reply as JSON instead of the table",
    )
    p.add_argument(
        "--timeout",
        dest="status_timeout",
        type=float,
        help="seconds to connect, and again to wait for the reply (10)",
    )
    return p


def settings_from(argv: list[str], environ: Mapping[str, str]) -> StatusSettings:
    """Flags over SHARDWIRE_* environment over defaults; with no coordinator given, a
    running standalone job's card of the run id (``jobcard.py``) says where and how."""
    given = {k: v for k, v in vars(parser().parse_args(argv)).items() if v is not None}
    settings = StatusSettings(**given)
    chosen = settings.model_fields_set
    if "coordinator" in chosen or chosen & {"token", "token_file"}:
        return settings
    card = lookup(cards_dir(environ), settings.run_id)
    if card is None:
        return settings
    update = {"coordinator": card.coordinator, "token_file": str(card.token_file)}
    return settings.model_copy(update=update)


async def fetch(settings: StatusSettings) -> StatusReply:
    """The coordinator's status reply (bounded by the settings' timeout)."""
    token = settings.token.get_secret_value() if settings.token else None
    tls = settings.tls_files()
    client = ControlClient(
        token=load_token(token, settings.token_file),
        run_id=settings.run_id,
        role="client",
        tls=tls.client_context() if tls else None,
    )
    host, port = settings.coordinator_address()
    try:
        replicas = settings.coordinator_replicas()
        await client.connect(host, port, timeout=settings.status_timeout, replicas=replicas)
        return await client.status(timeout=settings.status_timeout)
    finally:
        await client.aclose()


def render(reply: StatusReply) -> str:
    lines = [
        f"run {reply.run_id!r}: {reply.state}, world size {reply.world_size}, "
        f"generation {reply.generation}"
    ]
    if reply.max_restarts:
        lines[0] += f", restarts {reply.restarts} of {reply.max_restarts}"
    if reply.failure:
        lines.append(f"failure: {reply.failure}")
    if reply.straggler:
        lines.append(f"straggler: {reply.straggler}")
    if reply.slow_link:
        lines.append(f"slow link: {reply.slow_link}")
    if len(reply.generations) > 1 or reply.max_restarts:
        lines += [f"  {line}" for line in describe(reply.generations)]
    lines.append(
        f"{'rank':>4}  {'host':<16} {'node':<12} {'state':<8} {'step':>7} "
        f"{'heartbeat':>10} {'samples/s':>10}"
    )
    for r in reply.ranks:
        lines.append(
            f"{r.rank:>4}  {r.host:<16} {r.node_id:<12} {r.state:<8} {r.step:>7} "
            f"{r.heartbeat_age_s:>9.1f}s {r.samples_per_s:>10.0f}"
            + (f"  busy for {r.busy_s:.0f} s at {r.busy_at}" if r.busy_s else "")
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    settings = settings_from(argv, os.environ)
    reply = run(fetch(settings))
    print(json.dumps(reply.model_dump(), indent=2) if settings.json_output else render(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
