"""``shardwire ray``: run a script's ranks as actors on a Ray cluster.

    shardwire ray --num-workers 4 --workers-per-node 2 train.py --steps 200
    shardwire ray --address 10.0.0.1:6379 --num-workers 8 --max-restarts 3 train.py

Without ``--address`` it joins the cluster ``RAY_ADDRESS`` names, else starts a local
one (as ``ray.init()`` does). Exit status 0 when every rank finished; 1 with the first
failed rank's error otherwise; 2 for a bad option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from shardwire.protocol import InvalidArgument
from shardwire.ray import run
from shardwire.worker.chaos.faultlog import chaos_env

_EXAMPLES = """examples:
  shardwire ray --num-workers 4 --workers-per-node 2 train.py --steps 200
  shardwire ray --address 10.0.0.1:6379 --num-workers 8 --max-restarts 3 train.py
  shardwire chaos plan.toml -- shardwire ray --num-workers 4 --max-restarts 2 train.py"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire ray",
        description="Run a script's ranks as actors on a Ray cluster, with live recovery.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--address", help="the Ray cluster (HOST:PORT; default: RAY_ADDRESS or local)")
    p.add_argument("--num-workers", type=int, required=True, help="ranks in the job")
    p.add_argument(
        "--workers-per-node",
        type=int,
        default=1,
        help="ranks per shardwire node: one placement bundle on one host (1)",
    )
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs per rank (1)")
    p.add_argument(
        "--resources-per-worker",
        metavar="JSON",
        default="{}",
        help="custom Ray resources per rank, e.g. '{\"trainer\": 1}'",
    )
    p.add_argument(
        "--strategy",
        default="SPREAD",
        choices=["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"],
        help="how Ray spreads the bundles over nodes (SPREAD)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="failures the job recovers from live, at most (0: the first ends it)",
    )
    p.add_argument("--run-id", help="the job's name (default: ray- and a random suffix)")
    p.add_argument(
        "--join-timeout", type=float, default=300.0, help="seconds to wait for the ranks (300)"
    )
    p.add_argument(
        "--placement-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for Ray to place the ranks (60)",
    )
    p.add_argument(
        "--chaos",
        metavar="PLAN",
        default=os.environ.get("SHARDWIRE_CHAOS"),
        help="inject the faults of this plan file into the ranks (`shardwire chaos PLAN -- "
        "shardwire ray ...` sets it and judges them)",
    )
    p.add_argument("script", help="the script every rank runs (each node must see the path)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        resources = json.loads(args.resources_per_worker)
    except json.JSONDecodeError as exc:
        print(f"shardwire ray: --resources-per-worker is not JSON: {exc}", file=sys.stderr)
        return 2
    env = chaos_env(args.chaos, os.environ) if args.chaos else {}
    try:
        run(
            args.script,
            args.args,
            num_workers=args.num_workers,
            workers_per_node=args.workers_per_node,
            cpus_per_worker=args.cpus_per_worker,
            resources_per_worker=resources,
            strategy=args.strategy,
            max_restarts=args.max_restarts,
            address=args.address,
            run_id=args.run_id,
            join_timeout=args.join_timeout,
            placement_timeout=args.placement_timeout,
            env=env,
        )
    except InvalidArgument as exc:
        print(f"shardwire ray: invalid option: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # ray is an extra: the help works without it, a job does not
        print(f"shardwire ray: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
