"""``shardwire health``: exit 0 if the coordinator's /healthz answers 200 (for container
health checks, where slim images have no curl)."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire health``."""
    p = argparse.ArgumentParser(
        prog="shardwire health",
        description=__doc__,
        epilog="example:\n  shardwire health --url http://127.0.0.1:29480/healthz && echo up",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--url",
        default="http://127.0.0.1:29480/healthz",
        help="the coordinator's health endpoint: its status page's /healthz "
        "(coordinator --http-host and --http-port) (%(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        help="seconds to wait for the answer; no answer in time is unhealthy (%(default)s)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as response:  # noqa: S310
            ok = response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"shardwire health: {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1
