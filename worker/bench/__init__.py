"""Benchmarks shipped with the package (``shardwire bench ...``)."""

from __future__ import annotations

import argparse
import importlib

from shardwire.protocol import ShardwireError


class BenchmarkFailed(ShardwireError, RuntimeError):
    """A benchmark's job or baseline did not run to its end (a rank failed, a program
    did not finish in time); the message carries the tails of their output."""


# name -> (module, purpose); each parses its own arguments
BENCHES = {
    "collectives": (
        "shardwire.worker.bench.collectives",
        "time every collective on N local ranks, beside gloo, Open MPI or TCP only",
    ),
    "rendezvous": (
        "shardwire.worker.bench.rendezvous",
        "form a job of many simulated workers against a real coordinator",
    ),
    "transport": (
        "shardwire.worker.bench.transport",
        "point-to-point throughput and round trip beside raw sockets, with and without TLS",
    ),
    "fsdp": ("shardwire.worker.bench.fsdp", "step time and memory of every FSDP strategy"),
    "charlm": (
        "shardwire.worker.bench.charlm",
        "tokens/s: numpy charlm, torch on shardwire, torch on gloo (run in a checkout)",
    ),
    "checkpoint": (
        "shardwire.worker.bench.checkpoint",
        "save and load GB/s beside numpy.save, and an asynchronous save's stall",
    ),
    "parallel": (
        "shardwire.worker.bench.parallel",
        "the pipeline bubble beside theory; tensor parallel beside FSDP",
    ),
    "aggregation": (
        "shardwire.worker.bench.aggregation",
        "top-k bytes and accuracy, parameter server beside ring (run in a checkout)",
    ),
    "offload": ("shardwire.worker.bench.offload", "peak memory and step time with offload"),
    "trace": (
        "shardwire.worker.bench.trace",
        "what a timeline costs in tokens/s (run in a checkout)",
    ),
    "slowlink": (
        "shardwire.worker.bench.slowlink",
        "charlm on emulated hosts at link rates: data parallel, DiLoCo, streaming int8 (root)",
    ),
    "copies": (
        "shardwire.worker.bench.copies",
        "step time with peer copies beside none, and a replaced rank's restore",
    ),
    "goodput": (
        "shardwire.worker.bench.goodput",
        "charlm with a random fault every F seconds beside no faults (run in a checkout)",
    ),
    "ray": (
        "shardwire.ray.bench",
        "on a local Ray cluster: Ray Train over shardwire beside gloo; goodput beside launch",
    ),
}
_EXAMPLES = """examples:
  shardwire bench collectives --world 2 4 --sizes 4096 1048576 --compare-mpi
  shardwire bench collectives --compare-gloo --compare-torch --json out.json
  shardwire bench rendezvous --workers 1000
  shardwire bench transport --sizes 4K 1M 64M
  shardwire bench parallel --world 2 --json bubble.json
Each benchmark has its own --help."""


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench``: each benchmark's own is its module's."""
    p = argparse.ArgumentParser(
        prog="shardwire bench",
        description="Benchmarks measured side by side with their baselines, in one run.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (_module, purpose) in BENCHES.items():
        sub.add_parser(name, add_help=False, help=purpose)
    return p


def main(argv: list[str]) -> int:
    """``shardwire bench NAME ...``."""
    if argv[:1] and argv[0] in BENCHES:
        return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)
    parser().parse_args(argv)  # only reached for --help or an unknown name: prints and exits
    return 2
