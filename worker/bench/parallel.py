"""Model parallelism: the pipeline bubble measured next to the theoretical (p-1)/(m+p-1)
for 1F1B and (p-1)/(vm+p-1) for interleaved 1F1B with v chunks per rank, and
tensor-parallel step time next to FSDP's on the same model and global batch.

    shardwire bench parallel [--world 2 4] [--layers 16] [--json out.json]

Each world size runs as one ``shardwire launch --standalone`` job. Pipeline: the world
is one pipeline of p = world stages, each ``--layers`` 512-wide linear layers with a
GELU after each (a stage holds several layers, as a stage of a deep model does); the
bubble of a stage is 1 - (its own compute time) / (the step's wall time), averaged over
the stages, for m = 1, 2, 4 and 8 micro-batches of a 1,024-row batch. Interleaved: the
same layers per rank as two chunks of half of them each (v = 2, the model then has 2p
stages), for m = 4 and 8 where p divides m. Every pass also costs a hand-off to the
compute thread and a message, which the measurement counts as bubble: the fewer layers
a pass computes, the more they weigh. On a machine with fewer cores than stages the
stages also wait for a core, which counts as bubble too. Tensor parallel: a transformer
LM whose blocks are split over all ranks, against the same LM under FSDP FULL_SHARD
over all ranks.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.worker.bench.jobs import command_line, rank_side, run_job
from shardwire.worker.bench.stages import Stages

WIDTH, ROWS, STEPS = 512, 1024, 5
LM: dict[str, Any] = {"vocab": 96, "dim": 256, "heads": 8, "layers": 4, "context": 32}


class _Timed:
    """A stage module that adds up the time its forward and backward take."""

    def __init__(self, module):
        self.module, self.seconds = module, 0.0

    def __getattr__(self, name):
        return getattr(self.module, name)

    def _timed(self, fn, x):
        start = time.perf_counter()
        try:
            return fn(x)
        finally:
            self.seconds += time.perf_counter() - start

    def forward(self, x):
        return self._timed(self.module.forward, x)

    def backward(self, dy):
        return self._timed(self.module.backward, dy)


async def _pipeline(pg, micro: int, layers: int, chunks: int = 1) -> dict:
    from shardwire.worker.nn import GELU, Linear, Sequential, mse
    from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage

    rng = np.random.default_rng(pg.rank)
    per = layers // chunks  # the same layers, as `chunks` chunks of `per` each
    parts = [
        _Timed(
            Sequential(*(m for _ in range(per) for m in (Linear(WIDTH, WIDTH, rng=rng), GELU())))
        )
        for _ in range(chunks)
    ]
    schedule = "1f1b" if chunks == 1 else "interleaved"
    config = PipelineParallelConfig(pg.world_size, micro, schedule, chunks=chunks)
    stage = parts[0] if chunks == 1 else parts
    pipe = PipelineStage(stage, pg, config, loss=lambda y, t: mse(y, t, denom=ROWS))  # type: ignore[arg-type]
    x = np.random.default_rng(0).standard_normal((ROWS, WIDTH))
    walls, busy = [], []
    for _ in range(STEPS):
        await pg.barrier()
        for part in parts:
            part.seconds = 0.0
        start = time.perf_counter()
        await pipe.step(x if pipe.first else None, x if pipe.last else None)
        walls.append(time.perf_counter() - start)
        busy.append(sum(part.seconds for part in parts))
    bubbles = await pg.all_gather_object(1 - statistics.median(busy) / statistics.median(walls))
    p = pg.world_size
    return {
        "schedule": schedule,
        "chunks": chunks,
        "micro": micro,
        "layers": layers,
        "bubble": float(np.mean(bubbles)),
        "theory": (p - 1) / (chunks * micro + p - 1),
    }


async def _lm_step(fsdp, ids, targets) -> float:
    from shardwire.worker.nn import softmax_cross_entropy

    times = []
    for _ in range(STEPS):
        await fsdp.group.barrier()
        start = time.perf_counter()
        fsdp.zero_grad()
        logits = await fsdp.forward(ids)
        _, dlogits = softmax_cross_entropy(logits, targets, denom=targets.size)
        await fsdp.backward(dlogits)
        await fsdp.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


async def worker(layers: int) -> dict | None:
    import shardwire.worker as sw
    from shardwire.worker.fsdp import FSDP, by_type
    from shardwire.worker.nn import Block, TransformerLM
    from shardwire.worker.nn.parallel import ParallelBlock
    from shardwire.worker.optim import AdamW

    async with sw.init() as pg:
        pipeline = [await _pipeline(pg, m, layers) for m in (1, 2, 4, 8)]
        p = pg.world_size
        pipeline += [await _pipeline(pg, m, layers, 2) for m in (4, 8) if m % p == 0]
        rng = np.random.default_rng(1)
        ids = rng.integers(0, LM["vocab"], (8, LM["context"]))
        targets = np.roll(ids, -1, axis=1)
        mine = np.array_split(np.arange(len(ids)), pg.world_size)[pg.rank]
        # FSDP: every rank a slice of the batch. Tensor parallel: every rank the whole
        # batch, the blocks split (FSDP over a group of one only runs the optimizer).
        sharded = await FSDP.create(
            TransformerLM(**LM, rng=np.random.default_rng(0), dtype=np.float32),
            pg,
            optimizer=AdamW(lr=1e-3),
            policy=by_type(Block),
        )
        fsdp_ms = await _lm_step(sharded, ids[mine], targets[mine])
        solo = pg.new_group([pg.rank], name="solo")
        tp_model = TransformerLM(
            **LM,
            rng=np.random.default_rng(0),
            dtype=np.float32,
            block=functools.partial(ParallelBlock, group=pg),
        )
        parallel = await FSDP.create(tp_model, solo, optimizer=AdamW(lr=1e-3), strategy="no_shard")
        tp_ms = await _lm_step(parallel, ids, targets)
        if pg.rank != 0:
            return None
        return {"n": pg.world_size, "pipeline": pipeline, "fsdp_ms": fsdp_ms, "tp_ms": tp_ms}


def table(rows: list[dict]) -> str:
    """The rows as two markdown tables: the pipeline bubbles, then FSDP beside tensor
    parallel."""
    out = [
        "| stages p | layers a stage | schedule | chunks v | micro-batches m "
        "| bubble measured | theory |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for c in r["pipeline"]:
            out.append(
                f"| {r['n']} | {c['layers']} | {c['schedule']} | {c['chunks']} | {c['micro']} | "
                f"{c['bubble']:.0%} | {c['theory']:.0%} |"
            )
    out += [
        "",
        "| ranks | FSDP FULL_SHARD step (ms) | tensor parallel step (ms) |",
        "|---|---|---|",
    ]
    out += [f"| {r['n']} | {r['fsdp_ms']:.1f} | {r['tp_ms']:.1f} |" for r in rows]
    return "\n".join(out)


def report(rows: list[dict]) -> None:
    print(table(rows))


def parser() -> argparse.ArgumentParser:
    """The command line of ``shardwire bench parallel``."""
    p = command_line("parallel", __doc__)
    p.add_argument(
        "--world",
        type=int,
        nargs="+",
        default=[2, 4],
        help="ranks of a job, one job per value: the pipeline's stages, and the ranks the "
        "transformer's blocks are split over (2 4)",
    )
    p.add_argument("--layers", type=int, default=16, help="linear layers a stage (even)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        rank_side(args.worker, worker(args.layers))
        return
    if args.layers < 2 or args.layers % 2:
        p.error("--layers must be even (the interleaved schedule halves them)")
    rows = []
    with Stages("parallel", len(args.world)) as progress:
        for n in args.world:
            progress.start(f"{n} ranks: the pipeline's schedules, then tensor parallel and FSDP")
            rows.append(run_job("shardwire.worker.bench.parallel", n, "--layers", str(args.layers)))
    report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
