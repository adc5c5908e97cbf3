"""The ``shardwire`` command: ``coordinator``, ``worker`` and ``launch``."""

from __future__ import annotations

import argparse
import os
import sys

from pydantic import ValidationError

from shardwire.protocol import ShardwireError
from shardwire.worker.launcher.agent import run_node
from shardwire.worker.launcher.settings import LaunchSettings
from shardwire.worker.runtime import run

_EPILOG = "Every flag can also be given as SHARDWIRE_<FLAG> (e.g. SHARDWIRE_NPROC_PER_NODE=4)."


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, help="worker processes on this node (1)")
    p.add_argument("--node-id", help="this node's name (default: host name)")
    p.add_argument("--run-id", help="job identifier (shardwire)")
    p.add_argument("--token-file", help="file with the shared token (or SHARDWIRE_TOKEN)")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow non-loopback listeners without a token",
    )
    p.add_argument("--bind-host", help="address for the peer listeners")
    p.add_argument("--advertise-host", help="address peers should dial (default: as seen)")
    p.add_argument("--join-timeout", type=float, help="seconds to wait for the world (300)")
    p.add_argument("--term-timeout", type=float, help="grace after SIGTERM before SIGKILL (5)")
    p.add_argument(
        "--max-restarts",
        type=int,
        help="restart the job's processes from the latest checkpoint after this many "
        "failures at most (0)",
    )
    p.add_argument(
        "--stall-warn",
        type=float,
        help="seconds a worker's event loop may be busy before it is reported busy (10)",
    )
    p.add_argument("--tls-cert", help="PEM certificate: TLS on every connection (mutual)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that signs every member's certificate")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwire", description="Distributed training runtime.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "coordinator",
        add_help=False,
        help="run the rendezvous service (see: shardwire coordinator --help)",
    )
    w = sub.add_parser(
        "worker", epilog=_EPILOG, help="join a coordinator and run N processes of a script"
    )
    w.add_argument("--coordinator", help="HOST:PORT of the coordinator (127.0.0.1:29400)")
    w.add_argument("--nnodes", help="nodes in the job: N, or MIN:MAX for an elastic job (1)")
    _add_node_flags(w)
    la = sub.add_parser(
        "launch", epilog=_EPILOG, help="like worker; --standalone also starts a local coordinator"
    )
    la.add_argument(
        "--standalone",
        action="store_true",
        default=None,
        help="start a coordinator on 127.0.0.1 with a fresh token",
    )
    la.add_argument("--coordinator", help="HOST:PORT when not standalone")
    la.add_argument("--nnodes", help="nodes in the job: N, or MIN:MAX for an elastic job (1)")

    la.add_argument(
        "--heartbeat-timeout",
        type=float,
        help="with --standalone: silence that marks a worker dead (5)",
    )
    _add_node_flags(la)
    return p


def _settings(args: argparse.Namespace) -> LaunchSettings:
    skip = {"command", "module", "script", "args"}
    given = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    return LaunchSettings(**given)


def _child_argv(args: argparse.Namespace) -> list[str]:
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.args]
    return [sys.executable, "-u", args.script, *args.args]


def _bench(argv: list[str]) -> int:
    if argv[:1] == ["rendezvous"]:
        from shardwire.worker.bench.rendezvous import main as rendezvous_main

        return rendezvous_main(argv[1:])
    if argv[:1] != ["collectives"]:
        print("usage: shardwire bench {collectives,rendezvous} [--help]", file=sys.stderr)
        return 2
    from shardwire.worker.bench.collectives import main as bench_main

    return bench_main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["coordinator"]:
        # Hand over to the coordinator package in a fresh interpreter: the worker side
        # never imports it (layering), and the process is the coordinator from here on.
        os.execv(sys.executable, [sys.executable, "-m", "shardwire.coordinator", *argv[1:]])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["health"]:
        from shardwire.worker.launcher.health import main as health_main

        return health_main(argv[1:])
    if argv[:1] == ["checkpoint"]:
        from shardwire.worker.fsdp.tools import main as checkpoint_main

        return checkpoint_main(argv[1:])
    if argv[:1] == ["plot"]:
        from shardwire.worker.launcher.plot import main as plot_main

        return plot_main(argv[1:])
    if argv[:1] == ["status"]:
        from shardwire.worker.launcher.status import main as status_main

        try:
            return status_main(argv[1:])
        except ShardwireError as exc:
            print(f"shardwire status: {exc}", file=sys.stderr)
            return 1
    args = parser().parse_args(argv)
    try:
        settings = _settings(args)
        return run(run_node(settings, _child_argv(args)))
    except (ValidationError, ValueError) as exc:
        print(f"shardwire {args.command}: invalid option: {exc}", file=sys.stderr)
        return 2
    except ShardwireError as exc:
        print(f"shardwire {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
