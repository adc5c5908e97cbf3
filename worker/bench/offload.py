"""FSDP with offload against FSDP in memory, in one run: peak resident memory per rank
and step time, on a model of ``--mib`` MiB of parameters trained with AdamW.

    shardwire bench offload [--world 2 4] [--mib 256] [--layers 16] [--steps 4]
                                 [--reduce-depth 2] [--json out.json]

The model is ``--layers`` square float64 linear layers (one FSDP unit each), FULL_SHARD
with ``reduce_depth`` bounding the full gradients in flight, the same in both runs.
Each configuration runs as its own ``shardwire launch --standalone`` job. "Training
peak" is VmHWM from ``/proc/self/status`` over the training steps: the high-water mark
is reset (``/proc/self/clear_refs``) once the model is wrapped, because building the
full model before sharding it costs the same with or without offload. "Process peak"
is VmHWM over the whole process, model construction included. Offloaded pages live in
the page cache of their (unnamed) files, which the kernel writes back and evicts under
memory pressure; they are not part of a process's resident memory once paged out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from shardwire.worker.bench import BenchmarkFailed
from shardwire.worker.bench.jobs import command_line, rank_side, run_job
from shardwire.worker.bench.stages import Stages


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise BenchmarkFailed(f"/proc/self/status has no {field} line")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # noqa: ASYNC230 (a procfs write)
        fh.write("5")


async def worker(mib: int, layers: int, steps: int, depth: int, offload: bool) -> dict | None:
    import shardwire.worker as sw
    from shardwire.worker.fsdp import FSDP, Offload, by_type
    from shardwire.worker.nn import Linear, Sequential, mse
    from shardwire.worker.optim import AdamW

    side = int(math.sqrt(mib * 2**20 / 8 / layers))
    async with sw.init() as pg:
        rng = np.random.default_rng(0)
        model = Sequential(*(Linear(side, side, rng=rng) for _ in range(layers)))
        with tempfile.TemporaryDirectory(prefix="shardwire-offload-bench-") as spill:
            options = {"offload": Offload(directory=spill)} if offload else {}
            fsdp = await FSDP.create(
                model,
                pg,
                optimizer=AdamW(lr=1e-4),
                policy=by_type(Linear),
                reduce_depth=depth,
                **options,
            )
            del model
            process_peak = _status_kib("VmHWM")
            _reset_peak()
            x = np.random.default_rng(pg.rank).standard_normal((8, side))
            times = []
            for _ in range(steps):
                await pg.barrier()
                start = time.perf_counter()
                fsdp.zero_grad()
                out = await fsdp.forward(x)
                _, grad = mse(out, x, denom=len(x) * pg.world_size)
                await fsdp.backward(grad)
                await fsdp.step()
                times.append(time.perf_counter() - start)
            row = {
                "training_peak_kib": _status_kib("VmHWM"),
                "process_peak_kib": max(process_peak, _status_kib("VmHWM")),
                "step_s": statistics.median(times[1:] or times),
            }
            weights = await fsdp.state_dict()
            checksum = float(sum(np.abs(w).sum() for w in weights.values()))
            rows = await pg.all_gather_object(row)
            await fsdp.aclose()
        if pg.rank != 0:
            return None
        return {
            "n": pg.world_size,
            "offload": offload,
            "params_mib": layers * side * (side + 1) * 8 / 2**20,
            "training_peak_mib": max(r["training_peak_kib"] for r in rows) / 1024,
            "process_peak_mib": max(r["process_peak_kib"] for r in rows) / 1024,
            "step_s": max(r["step_s"] for r in rows),
            "checksum": checksum,
        }


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, and whether offload changed the trained weights."""
    out = [
        "| ranks | model MiB | offload | training peak MiB / rank | vs in memory "
        "| process peak MiB | step s | step vs in memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {r["n"]: r for r in rows if not r["offload"]}
    for r in rows:
        b = base[r["n"]]
        out.append(
            f"| {r['n']} | {r['params_mib']:.0f} | {'yes' if r['offload'] else 'no'} | "
            f"{r['training_peak_mib']:.0f} | {r['training_peak_mib'] / b['training_peak_mib']:.0%}"
            f" | {r['process_peak_mib']:.0f} | {r['step_s']:.2f} | "
            f"{r['step_s'] / b['step_s']:.2f}x |"
        )
    for n, b in base.items():
        same = all(r["checksum"] == b["checksum"] for r in rows if r["n"] == n)
        out.append(f"\n{n} ranks: trained weights identical with and without offload: {same}")
    return "\n".join(out)


def report(rows: list[dict]) -> None:
    print(table(rows))


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench offload``."""
    p = command_line("offload", __doc__)
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[2, 4],
        help="ranks of a job, two jobs (in memory, offloaded) per value (2 4)",
    )
    p.add_argument("--mib", type=int, default=256, help="parameter MiB of the model")
    p.add_argument(
        "--layers",
        type=int,
        default=16,
        help="square linear layers the parameters are split into, one FSDP unit each (%(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=4,
        help="AdamW steps trained; the step time is the median past the first (%(default)s)",
    )
    p.add_argument(
        "--reduce-depth",
        type=int,
        default=2,
        help="FSDP's reduce_depth: full gradients in flight at most, in both runs (%(default)s)",
    )
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        rank_side(
            args.worker, worker(args.mib, args.layers, args.steps, args.reduce_depth, args.offload)
        )
        return
    rows = []
    with Stages("offload", len(args.world) * 2) as progress:
        for n in args.world:
            for flag in ([], ["--offload"]):
                progress.start(f"{n} ranks, {args.mib} MiB: {'offloaded' if flag else 'in memory'}")
                extra = ["--mib", str(args.mib), "--layers", str(args.layers), "--steps"]
                extra += [str(args.steps), "--reduce-depth", str(args.reduce_depth), *flag]
                rows.append(run_job("shardwire.worker.bench.offload", n, *extra))
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
