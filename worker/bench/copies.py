"""What peer copies cost (``PeerCopies``, live recovery): step time with a copy every K
steps beside no copies, in the same job, and the time a replaced rank takes to get its
state back from its holder.

    shardwire bench copies [--nproc 4] [--every 1 5 20] [--rounds 6] [--json out.json]

One job of N local ranks trains the FSDP benchmark's transformer (FULL_SHARD, AdamW).
Each round runs a block of steps without copies, then a block with a copy every K steps
(for each K), so the modes alternate over the run on this noisy machine; the overhead
is the median step time with copies over the one without, minus one. Then rank 1's
copies are dropped (its process died) and every rank restores: the seconds that takes,
and the bytes of rank 1's state that came back over the wire.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.worker.bench.fsdp import MODEL
from shardwire.worker.bench.jobs import command_line, rank_side, run_job
from shardwire.worker.bench.stages import Stages

BATCH = 4  # sequences per rank


async def _block(fsdp, ids, targets, steps: int, *, copies, first: int) -> list[float]:
    from shardwire.worker.nn import softmax_cross_entropy

    times = []
    for i in range(steps):
        await fsdp.group.barrier()
        start = time.perf_counter()
        fsdp.zero_grad()
        logits = await fsdp.forward(ids)
        _, dlogits = softmax_cross_entropy(logits, targets, denom=ids.size * fsdp.group.size)
        await fsdp.backward(dlogits)
        await fsdp.step(lr=1e-3)
        if copies is not None:
            await copies.save(fsdp, first + i + 1)
        times.append(time.perf_counter() - start)
    if copies is not None:
        await copies.wait()
    return times


async def _rounds(
    fsdp, ids, targets, every_copies: dict, *, rounds: int, steps: int, progress: Stages | None
) -> dict[str, list[float]]:
    """Each round, a block of ``steps`` without copies, then one with each of
    ``every_copies``: every block's step times, by mode (``none`` or K)."""
    times: dict[str, list[float]] = {"none": [], **{str(k): [] for k in every_copies}}
    step = 0
    await _block(fsdp, ids, targets, 2, copies=None, first=step)  # warm-up
    for turn in range(rounds):
        for key in times:
            if progress is not None:
                said = "no copies" if key == "none" else f"a copy every {key} steps"
                progress.start(f"round {turn + 1}/{rounds}: {steps} steps, {said}")
            copies = None if key == "none" else every_copies[int(key)]
            times[key] += await _block(fsdp, ids, targets, steps, copies=copies, first=step)
            step += steps
    return times


async def worker(everies: list[int], rounds: int, steps: int, *, bar: bool) -> dict | None:
    import shardwire.worker as sw
    from shardwire.worker.fsdp import FSDP, PeerCopies, Strategy, by_type
    from shardwire.worker.nn import Block, TransformerLM
    from shardwire.worker.optim import AdamW

    async with sw.init() as pg:
        rng = np.random.default_rng(pg.rank)
        ids = rng.integers(0, MODEL["vocab"], (BATCH, MODEL["context"]))
        targets = np.roll(ids, -1, axis=1)

        async def build() -> FSDP:
            model = TransformerLM(**MODEL, rng=np.random.default_rng(0), dtype=np.float32)
            return await FSDP.create(
                model,
                pg,
                optimizer=AdamW(lr=1e-3),
                strategy=Strategy.FULL_SHARD,
                policy=by_type(Block),
            )

        fsdp = await build()
        every_copies = {k: PeerCopies(k, ranks_per_node=pg.local_world_size) for k in everies}
        # rank 0 says where the run is: each block of each round, then the restore
        total = rounds * (1 + len(every_copies)) + 1
        progress = Stages("copies", total, terminal=bar) if pg.rank == 0 else None
        times = await _rounds(
            fsdp, ids, targets, every_copies, rounds=rounds, steps=steps, progress=progress
        )
        if progress is not None:
            progress.start("rank 1's copies dropped: every rank restores")
        largest = every_copies[min(everies)]
        state_bytes = largest.state_bytes
        await fsdp.aclose()
        if pg.rank == 1:
            largest = PeerCopies(min(everies), ranks_per_node=pg.local_world_size)
        fresh = await build()  # what a re-formed generation builds
        await pg.barrier()
        start = time.perf_counter()
        resumed = await largest.restore(fresh)
        restore_s = time.perf_counter() - start
        spent = await pg.all_gather_object(restore_s)
        await fresh.aclose()
        if progress is None:
            return None
        progress.close()
        base = statistics.median(times["none"])
        return {
            "nproc": pg.world_size,
            "steps_per_block": steps,
            "rounds": rounds,
            "step_ms": round(base * 1e3, 2),
            "overhead": {
                k: round(statistics.median(v) / base - 1, 4)
                for k, v in times.items()
                if k != "none"
            },
            "state_bytes_per_rank": state_bytes,
            "restored_step": resumed.step if resumed else None,
            "restore_s": round(max(spent), 3),
        }


def table(r: dict[str, Any]) -> str:
    lines = [
        f"peer copies: {r['nproc']} ranks, FULL_SHARD, {r['step_ms']:.1f} ms a step without "
        f"copies; {r['state_bytes_per_rank'] / 2**20:.2f} MiB of state per rank",
        "  copy every (steps)  step time vs none",
    ]
    for every, over in r["overhead"].items():
        lines.append(f"  {every:>18}  {over:+.1%}")
    lines.append(
        f"  a replaced rank's state back from its holder and every rank rolled back to step "
        f"{r['restored_step']}: {r['restore_s']:.3f} s"
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench copies``."""
    p = command_line("copies", __doc__)
    p.add_argument("--nproc", type=int, default=4, help="local ranks of the one job (%(default)s)")
    p.add_argument(
        "--every",
        type=int,
        nargs="+",
        default=[1, 5, 20],
        help="steps between peer copies: each value is a mode timed beside no copies (1 5 20)",
    )
    p.add_argument("--rounds", type=int, default=6, help="alternations of the modes")
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--bar", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.worker:
        rank_side(args.worker, worker(args.every, args.rounds, args.steps, bar=args.bar))
        return
    # rank 0 draws the bar when this process's standard error, which its own reaches
    # through the launcher, is a terminal
    flags = ["--bar"] if sys.stderr.isatty() else []
    flags += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--every"]
    result = run_job("shardwire.worker.bench.copies", args.nproc, *flags, *map(str, args.every))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
