"""FSDP step time per strategy, with and without prefetch, on a small transformer; the
share of all-gather time that prefetch hides; and per-rank memory by category.

    shardwire bench fsdp [--world 2 4] [--steps 12] [--transport auto tcp] [--json out.json]

Each world size runs as one ``shardwire launch --standalone`` job per transport
(``SHARDWIRE_TRANSPORT``: "auto" moves large payloads between the ranks through shared
memory, "tcp" keeps every byte on loopback TCP), in the same invocation. "Hidden" is
1 - (time compute waited for all-gathers with prefetch) / (the same without prefetch),
measured inside the wrapper (``FSDP.gather_wait_s``): 100 % means the gathers cost
compute nothing. "Blocked in hooks" (``FSDP.hook_wait_s``) is all the compute thread
waited for in the units' hooks: the all-gathers, gradient reductions in flight, and the
hand-offs to the event loop and back, which every strategy pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.worker.bench.jobs import command_line, rank_side, run_job
from shardwire.worker.bench.stages import Stages

# Wide and shallow-batched, so parameter traffic is a visible share of a CPU step.
MODEL: dict[str, Any] = {"vocab": 96, "dim": 256, "heads": 4, "layers": 8, "context": 32}
BATCH = 2  # sequences per rank


async def step_time(fsdp, ids, targets, steps: int) -> tuple[float, float, float]:
    """Median step time, and per step the seconds compute waited for all-gathers and
    the seconds it was blocked in hooks (see ``FSDP.hook_wait_s``)."""
    from shardwire.worker.nn import softmax_cross_entropy

    times = []
    denom = ids.size * fsdp.group.size
    waited = blocked = 0.0
    for i in range(steps + 2):
        await fsdp.group.barrier()
        start = time.perf_counter()
        fsdp.zero_grad()
        logits = await fsdp.forward(ids)
        _, dlogits = softmax_cross_entropy(logits, targets, denom=denom)
        await fsdp.backward(dlogits)
        await fsdp.step(lr=1e-3)
        if i == 1:  # two warm-up steps
            waited, blocked = fsdp.gather_wait_s, fsdp.hook_wait_s
        if i >= 2:
            times.append(time.perf_counter() - start)
    return (
        statistics.median(times),
        (fsdp.gather_wait_s - waited) / steps,
        (fsdp.hook_wait_s - blocked) / steps,
    )


async def gather_time(fsdp, repeats: int = 5) -> float:
    """All-gathers of one step (forward and backward re-gather), without compute."""
    units = fsdp.all_units()
    times = []
    for _ in range(repeats):
        await fsdp.group.barrier()
        start = time.perf_counter()
        for _ in range(2):
            for unit in units:
                await unit.gather()
                unit.free()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def worker(steps: int, depth: int) -> list[dict] | None:
    import shardwire.worker as sw
    from shardwire.worker.fsdp import FSDP, Strategy, by_type
    from shardwire.worker.nn import Block, TransformerLM
    from shardwire.worker.optim import AdamW

    async with sw.init() as pg:
        rng = np.random.default_rng(pg.rank)
        ids = rng.integers(0, MODEL["vocab"], (BATCH, MODEL["context"]))
        targets = np.roll(ids, -1, axis=1)
        rows = []
        plans = [
            (Strategy.NO_SHARD, False),
            (Strategy.SHARD_GRAD_OP, False),
            (Strategy.FULL_SHARD, False),
            (Strategy.FULL_SHARD, True),
        ]
        if pg.world_size >= 4:
            plans += [(Strategy.HYBRID_SHARD, False), (Strategy.HYBRID_SHARD, True)]
        for strategy, prefetch in plans:
            model = TransformerLM(**MODEL, rng=np.random.default_rng(0), dtype=np.float32)
            fsdp = await FSDP.create(
                model,
                pg,
                optimizer=AdamW(lr=1e-3),
                strategy=strategy,
                policy=by_type(Block),
                prefetch=prefetch,
                prefetch_depth=depth,
                shard_size=2,
            )
            seconds, waited, blocked = await step_time(fsdp, ids, targets, steps)
            gathers = await gather_time(fsdp) if strategy.shards_params else 0.0
            stats = fsdp.memory_stats()["held"]
            rows.append(
                {
                    "strategy": strategy.name,
                    "prefetch": prefetch,
                    "step_ms": seconds * 1e3,
                    "gather_ms": gathers * 1e3,
                    "wait_ms": waited * 1e3,
                    "hooks_ms": blocked * 1e3,
                    "memory": stats,
                    "n": pg.world_size,
                }
            )
        return rows if pg.rank == 0 else None


def report(rows: list[dict]) -> None:
    print(
        "| n | transport | strategy | prefetch | step (ms) | step vs NO_SHARD "
        "| all-gathers alone (ms) | compute waited for all-gathers (ms) "
        "| hidden by prefetch | blocked in hooks (ms) "
        "| params MiB | grads MiB | optimizer MiB | total vs NO_SHARD |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, transport in sorted({(r["n"], r["transport"]) for r in rows}):
        mine = [r for r in rows if r["n"] == n and r["transport"] == transport]
        base = next(sum(r["memory"].values()) for r in mine if r["strategy"] == "NO_SHARD")
        step = {(r["strategy"], r["prefetch"]): r["step_ms"] for r in mine}
        without = {r["strategy"]: r["wait_ms"] for r in mine if not r["prefetch"]}
        for r in mine:
            hidden = "-"
            if r["prefetch"] and without.get(r["strategy"]):
                hidden = f"{1 - r['wait_ms'] / without[r['strategy']]:.0%}"
            m = r["memory"]
            ratio = r["step_ms"] / step[("NO_SHARD", False)]
            print(
                f"| {n} | {transport} | {r['strategy']} | {'on' if r['prefetch'] else 'off'} | "
                f"{r['step_ms']:.1f} | {ratio:.2f} | {r['gather_ms']:.1f} | "
                f"{r['wait_ms']:.1f} | {hidden} | {r['hooks_ms']:.1f} | "
                f"{m['params'] / 2**20:.2f} | {m['grads'] / 2**20:.2f} | "
                f"{m['optimizer'] / 2**20:.2f} | {sum(m.values()) / base:.2f} |"
            )


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench fsdp``."""
    p = command_line("fsdp", __doc__)
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[2, 4],
        help="ranks of a job, one job per value and transport (2 4)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=12,
        help="timed steps per strategy and prefetch setting, after two warm-up steps; the "
        "median is kept (%(default)s)",
    )
    p.add_argument("--prefetch-depth", type=int, default=1, help="units gathered ahead")
    p.add_argument(
        "--transport",
        nargs="+",
        default=["auto", "tcp"],
        choices=["auto", "tcp"],
        help="SHARDWIRE_TRANSPORT of each run (default: both, side by side)",
    )
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        rank_side(args.worker, worker(args.steps, args.prefetch_depth))
        return
    rows = []
    jobs = [(n, t) for n in args.world for t in args.transport]
    with Stages("fsdp", len(jobs)) as progress:
        for n, transport in jobs:
            progress.start(f"{n} ranks, {transport} transport: every strategy")
            flags = ["--steps", str(args.steps), "--prefetch-depth", str(args.prefetch_depth)]
            found = run_job(
                "shardwire.worker.bench.fsdp", n, *flags, env={"SHARDWIRE_TRANSPORT": transport}
            )
            rows += [{**r, "transport": transport} for r in found]
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
