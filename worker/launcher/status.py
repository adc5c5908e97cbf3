"""``shardwire status``: ask a running coordinator for the job state and print it."""

from __future__ import annotations

import argparse
import json
import os
import sys

from shardwire.protocol.auth import load_token
from shardwire.protocol.messages import StatusReply
from shardwire.worker.control import ControlClient
from shardwire.worker.runtime import run
from shardwire.worker.tls import TlsFiles


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwire status", description=__doc__)
    p.add_argument(
        "--coordinator", default=os.environ.get("SHARDWIRE_COORDINATOR", "127.0.0.1:29400")
    )
    p.add_argument("--run-id", default=os.environ.get("SHARDWIRE_RUN_ID", "shardwire"))
    p.add_argument("--token-file", default=os.environ.get("SHARDWIRE_TOKEN_FILE"))
    p.add_argument("--json", action="store_true", help="print the raw reply as JSON")
    p.add_argument("--timeout", type=float, default=10.0)
    return p


async def fetch(
    host: str,
    port: int,
    *,
    run_id: str,
    token_secret: str | None,
    token_file: str | None,
    timeout: float,
) -> StatusReply:
    tls = TlsFiles.from_env(os.environ)
    client = ControlClient(
        token=load_token(token_secret, token_file),
        run_id=run_id,
        role="client",
        tls=tls.client_context() if tls else None,
    )
    try:
        await client.connect(host, port, timeout=timeout)
        return await client.status(timeout=timeout)
    finally:
        await client.aclose()


def render(reply: StatusReply) -> str:
    lines = [
        f"run {reply.run_id!r}: {reply.state}, world size {reply.world_size}, "
        f"generation {reply.generation}"
    ]
    if reply.failure:
        lines.append(f"failure: {reply.failure}")
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
    args = parser().parse_args(argv)
    host, _, port = args.coordinator.rpartition(":")
    reply = run(
        fetch(
            host,
            int(port),
            run_id=args.run_id,
            token_secret=os.environ.get("SHARDWIRE_TOKEN"),
            token_file=args.token_file,
            timeout=args.timeout,
        )
    )
    print(json.dumps(reply.model_dump(), indent=2) if args.json else render(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
