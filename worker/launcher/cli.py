"""The ``shardwire`` command. ``worker`` and ``launch`` are parsed here; every other
command is served by its own module, which has its own ``--help`` (``TOOLS``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pydantic import ValidationError

from shardwire.protocol import ShardwireError
from shardwire.worker.launcher.agent import run_node
from shardwire.worker.launcher.direct import run_rank
from shardwire.worker.launcher.options import LaunchSettings
from shardwire.worker.runtime.loop import run

_EPILOG = "Every flag can also be given as SHARDWIRE_<FLAG> (e.g. SHARDWIRE_NPROC_PER_NODE=4)."

# Commands served by their own modules: name -> (module, purpose). Each parses its own
# arguments; ``shardwire NAME --help`` shows them.
TOOLS: dict[str, tuple[str, str]] = {
    "coordinator": ("shardwire.coordinator", "run the rendezvous and liveness service"),
    "status": ("shardwire.worker.launcher.status", "show a running job's ranks and history"),
    "checkpoint": (
        "shardwire.worker.fsdp.tools",
        "inspect, verify or consolidate a checkpoint without a job",
    ),
    "bench": ("shardwire.worker.bench", "time collectives or rendezvous, beside baselines"),
    "plot": ("shardwire.worker.launcher.plot", "draw a run directory's loss and throughput"),
    "health": ("shardwire.worker.launcher.health", "exit 0 if a coordinator is healthy"),
    "chaos": (
        "shardwire.worker.chaos.command",
        "run a job with a fault plan and say what each fault cost it",
    ),
    "trace": ("shardwire.worker.observe.trace", "merge a traced job's timelines into one file"),
    "ray": ("shardwire.ray.command", "run a job's ranks as actors on a Ray cluster"),
    "kubernetes": (
        "shardwire.worker.launcher.kubernetes",
        "render Kubernetes manifests for a job of N nodes",
    ),
}
_EXAMPLES = """examples:
  shardwire launch --standalone --nproc-per-node 4 train.py   one host, four ranks
  shardwire coordinator --world-size 8                        the service for a job
  shardwire worker --coordinator 10.0.0.1:29400 --nnodes 2 --nproc-per-node 4 train.py
  srun --ntasks-per-node 1 shardwire worker --nproc-per-node 4 train.py   Slurm, per node
  srun -n 8 shardwire run train.py                            Slurm, one task per rank
  shardwire kubernetes --name job --nodes 4 train.py | kubectl apply -f -   Indexed Job
  shardwire status --coordinator 10.0.0.1:29400               what the job is doing
  shardwire checkpoint verify runs/ckpt                       every digest checked
  shardwire bench collectives --world 2 4 --compare-mpi       against Open MPI
Every command has its own --help."""


def _add_coordinator_port(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--coordinator-port",
        type=int,
        help="port of the coordinator a scheduler's first node starts (under Slurm: "
        "20000 + job id mod 10000)",
    )


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, help="worker processes on this node (1)")
    p.add_argument(
        "--max-restarts",
        type=int,
        help="failures the job recovers from, at most, as --recovery says (0: the first "
        "failure ends the job)",
    )
    p.add_argument(
        "--recovery",
        choices=["relaunch", "live"],
        help="how the job recovers from a rank's failure, while --max-restarts lasts. "
        "live (the default): only the failed rank's process is started anew (forked, "
        "unless --no-fork), while the other ranks keep their "
        "processes and re-form (a script that does not call session.reform or "
        "session.recovering ends, and is started anew too). relaunch: every process of "
        "the job is stopped and started again, and the script resumes from what it saved "
        "(its latest checkpoint)",
    )
    p.add_argument(
        "--no-fork",
        dest="fork_ranks",
        action="store_false",
        default=None,
        help="each node starts one process that imports shardwire and what the script "
        "imports, and forks the node's rank processes from it (at the start, on a relaunch "
        "and a failed rank's replacement), so a rank starts in milliseconds and the "
        "node's ranks import once between them; this flag starts each rank's process "
        "with python instead (for a script that needs an interpreter of its own)",
    )
    p.add_argument(
        "--chaos",
        metavar="PLAN",
        help="inject the faults of this plan file into this node's ranks (and the "
        "coordinator it starts); `shardwire chaos` also judges them",
    )
    _add_rank_flags(p)


def _add_rank_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-id", help="this node's name (default: host name)")
    p.add_argument("--run-id", help="job identifier (shardwire; under Slurm slurm-JOB.STEP)")
    p.add_argument("--token-file", help="file with the shared token (or SHARDWIRE_TOKEN)")
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow non-loopback listeners without a token",
    )
    p.add_argument("--bind-host", help="address for the peer listeners")
    p.add_argument(
        "--peer-port-range",
        metavar="LOW-HIGH",
        help="ports the peer listeners take, one per rank of the node (e.g. 29500-29563, "
        "for a firewall; default: ephemeral)",
    )
    p.add_argument("--advertise-host", help="address peers should dial (default: as seen)")
    p.add_argument("--join-timeout", type=float, help="seconds to wait for the world (300)")
    p.add_argument(
        "--term-timeout",
        type=float,
        help="after a rank fails, the grace its node's other ranks get to end by themselves "
        "before SIGTERM, and after SIGTERM before SIGKILL (5)",
    )
    p.add_argument(
        "--leave-timeout",
        type=float,
        help="with --recovery live: when this node's agent is sent SIGTERM (a preemption "
        "notice), the grace its ranks get to hand their state over at their next copy "
        "step and leave, before SIGKILL (30)",
    )
    p.add_argument(
        "--stall-warn",
        type=float,
        help="seconds a worker's event loop may be busy before it is reported busy (10)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        default=None,
        help="record every rank's timeline (collectives, FSDP phases, sw.span) into "
        "--trace-dir: rank-R.json and the merged job.json, for Perfetto",
    )
    p.add_argument("--trace-dir", help="where --trace writes (traces/RUN_ID)")
    p.add_argument("--tls-cert", help="PEM certificate: TLS on every connection (mutual)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", help="PEM CA that signs every member's certificate")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardwire",
        description="Distributed training runtime.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    w = sub.add_parser(
        "worker",
        epilog="example:\n  shardwire worker --coordinator 10.0.0.1:29400 --nnodes 2 "
        "--nproc-per-node 4 train.py\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="join a coordinator and run N processes of a script",
    )
    w.add_argument(
        "--coordinator",
        help="HOST:PORT of the coordinator (127.0.0.1:29400; under Slurm or Kubeflow: "
        "started by the first node, on its address)",
    )
    w.add_argument("--nnodes", help="nodes in the job: N, or MIN:MAX for an elastic job (1)")
    w.add_argument(
        "--node-rank",
        type=int,
        help="this node's index, which orders the node ranks (else the scheduler's: the "
        "node's place in Slurm's node list, JOB_COMPLETION_INDEX, PET_NODE_RANK; nodes "
        "without one follow in the order of their node ids)",
    )
    _add_coordinator_port(w)
    _add_node_flags(w)
    r = sub.add_parser(
        "run",
        epilog="examples:\n  srun -N 2 --ntasks-per-node 4 shardwire run train.py --lr 3e-4\n"
        "  srun -n 8 shardwire run --token-file ~/.shardwire-token -m mypackage.train\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run one rank of a script per scheduler task (Slurm's srun -n N), no agent",
    )
    r.add_argument("--coordinator", help="HOST:PORT of a coordinator (default: rank 0 starts one)")
    _add_coordinator_port(r)
    _add_rank_flags(r)
    la = sub.add_parser(
        "launch",
        epilog="examples:\n  shardwire launch --standalone --nproc-per-node 4 train.py\n"
        "  shardwire launch --standalone --nproc-per-node 2 -m mypackage.train --lr 3e-4\n"
        + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="like worker; --standalone also starts a local coordinator",
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
    for name, (_module, purpose) in TOOLS.items():
        sub.add_parser(name, add_help=False, help=purpose)
    return p


def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    """The launch settings the parsed command line gives (unset options left out)."""
    skip = {"command", "module", "script", "args"}
    given = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    return LaunchSettings(**given)


def _child_argv(args: argparse.Namespace) -> list[str]:
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.args]
    return [sys.executable, "-u", args.script, *args.args]


def _tool(name: str, argv: list[str]) -> int:
    if name == "coordinator":
        # Hand over to the coordinator package in a fresh interpreter: the worker side
        # never imports it (layering), and the process is the coordinator from here on.
        os.execv(sys.executable, [sys.executable, "-m", "shardwire.coordinator", *argv])
    tool = importlib.import_module(TOOLS[name][0])
    try:
        return int(tool.main(argv))
    except ShardwireError as exc:
        print(f"shardwire {name}: {exc}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in TOOLS:
        return _tool(argv[0], argv[1:])
    args = parser().parse_args(argv)
    try:
        settings = launch_settings(args)
        # the stock loop: uvloop's process spawning leaves its own descriptors (the
        # children's /dev/null, pipe copies) open in every child it starts, five per
        # worker; a launcher's loop carries little traffic
        if args.command == "run":
            return run(run_rank(settings, _child_argv(args)), use_uvloop=False)
        return run(run_node(settings, _child_argv(args)), use_uvloop=False)
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
