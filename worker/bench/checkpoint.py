"""Checkpoint save and load throughput next to the raw write speed of the same bytes, and
the training stall an asynchronous save causes.

    shardwire bench checkpoint [--world 1 2 4] [--mib 256] [--json out.json]

The model is two square float64 linear layers of ``--mib`` MiB of parameters in all,
trained one AdamW step so the checkpoint also holds the optimizer state (3x the
parameter bytes). Each world size runs as one ``shardwire launch --standalone`` job in a
temporary directory. "Raw" is one ``numpy.save`` of the same number of bytes by rank 0,
fsynced, in the same job. For an asynchronous save, "blocked" is the time training is
held (the snapshot into memory), as a share of the save's duration; "slowed" is the step
time added while the save writes in the background (CPU and disk shared with training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from shardwire.worker.bench.jobs import command_line, rank_side, run_job
from shardwire.worker.bench.stages import Stages


def _model(mib: int):
    from shardwire.worker.nn import Linear, Sequential

    side = int(math.sqrt(mib * 2**20 / 8 / 2))  # two side x side float64 matrices
    rng = np.random.default_rng(0)
    return Sequential(Linear(side, side, rng=rng), Linear(side, side, rng=rng)), side


async def _step(fsdp, x: np.ndarray) -> float:
    from shardwire.worker.nn import mse

    start = time.perf_counter()
    fsdp.zero_grad()
    out = await fsdp.forward(x)
    _, grad = mse(out, x, denom=len(x) * fsdp.group.size)
    await fsdp.backward(grad)
    await fsdp.step()
    return time.perf_counter() - start


def _raw_write(directory: Path, nbytes: int) -> float:
    data = np.ones(nbytes // 8)
    path = directory / "raw.npy"
    start = time.perf_counter()
    with open(path, "wb") as fh:
        np.save(fh, data)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


async def worker(directory: str, mib: int) -> dict | None:
    import shardwire.worker as sw
    from shardwire.worker.fsdp import FSDP, by_type
    from shardwire.worker.nn import Linear
    from shardwire.worker.optim import AdamW

    root = Path(directory)
    async with sw.init() as pg:
        model, side = _model(mib)
        fsdp = await FSDP.create(model, pg, optimizer=AdamW(lr=1e-4), policy=by_type(Linear))
        x = np.random.default_rng(pg.rank).standard_normal((4, side))
        await _step(fsdp, x)
        await pg.barrier()
        report = await fsdp.save(root / "sync", step=1)
        nbytes = sum(await pg.all_gather_object(report.bytes_written))
        await pg.barrier()
        start = time.perf_counter()
        await fsdp.load(root / "sync")
        await pg.barrier()
        load_s = time.perf_counter() - start
        raw_s = _raw_write(root, nbytes) if pg.rank == 0 else 0.0
        quiet = [await _step(fsdp, x) for _ in range(3)]
        work = await fsdp.save(root / "async", step=2, blocking=False)
        during = []
        while not work.done():
            during.append(await _step(fsdp, x))
        background = await work.wait()
        slowed = max(0.0, sum(during) - len(during) * float(np.median(quiet)))
        if pg.rank != 0:
            return None
        return {
            "n": pg.world_size,
            "bytes": nbytes,
            "save_s": report.total_s,
            "load_s": load_s,
            "raw_s": raw_s,
            "async_s": background.total_s,
            "blocked_s": background.stall_s,
            "slowed_s": slowed,
            "steps_during": len(during),
        }


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    out = [
        "| n | checkpoint MiB | save GB/s | load GB/s | raw numpy.save GB/s | save / raw "
        "| async save s | blocked s | blocked / save | slowed s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gb = r["bytes"] / 1e9
        out.append(
            f"| {r['n']} | {r['bytes'] / 2**20:.0f} | {gb / r['save_s']:.2f} | "
            f"{gb / r['load_s']:.2f} | {gb / r['raw_s']:.2f} | {r['raw_s'] / r['save_s']:.0%} | "
            f"{r['async_s']:.2f} | {r['blocked_s']:.3f} | {r['blocked_s'] / r['async_s']:.0%} | "
            f"{r['slowed_s']:.2f} |"
        )
    return "\n".join(out)


def report(rows: list[dict]) -> None:
    print(table(rows))


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench checkpoint``."""
    p = command_line("checkpoint", __doc__)
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        help="ranks of a job, one job and row per value (1 2 4)",
    )
    p.add_argument("--mib", type=int, default=256, help="parameter MiB of the model")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        rank_side(args.worker, worker(os.environ["SHARDWIRE_BENCH_DIR"], args.mib))
        return
    rows = []
    with Stages("checkpoint", len(args.world)) as progress:
        for n in args.world:
            ranks = f"{n} rank{'' if n == 1 else 's'}"
            progress.start(f"{ranks}: save, load and an asynchronous save of {args.mib} MiB")
            rows.append(run_job("shardwire.worker.bench.checkpoint", n, "--mib", str(args.mib)))
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
