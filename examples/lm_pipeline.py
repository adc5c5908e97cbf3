"""Pipeline-parallel training of the character model: used by ``charlm.py --pp N``.

Each group of N consecutive ranks is one pipeline: the model's layers (embeddings, the
blocks, the head) are split into N contiguous stages balanced by parameter count, the
batch into ``--micro-batches`` micro-batches that flow through them under the 1F1B
schedule. Groups of ranks holding the same stage sum their gradients (pipeline x data
parallel); every stage runs AdamW on its own parameters.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import shardwire.worker as sw
from shardwire.worker.nn import Sequential, TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage, split_into_stages
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runlog import RunLog


async def train_pipeline(
    args: argparse.Namespace, pg: sw.ProcessGroup, train: np.ndarray, vocab: int, log: RunLog
) -> dict:
    """Train for ``args.steps`` steps; returns the summary (rank 0's view)."""
    from charlm import windows  # the sibling example's data windows

    pp = args.pp
    if pg.world_size % pp:
        raise ValueError(f"--pp {pp} does not divide the {pg.world_size} ranks")
    start = pg.rank - pg.rank % pp
    pipe_group = pg.new_group(range(start, start + pp), name="pipe")
    replicas = pg.new_group(range(pg.rank % pp, pg.world_size, pp), name="replicas")
    model = TransformerLM(
        vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers,
        context=args.context, rng=np.random.default_rng(args.seed), dtype=np.float32,
    )  # fmt: skip
    layers = model.pipeline_layers()
    sizes = [sum(p.size for _, p in layer.named_parameters()) for layer in layers]
    stage = Sequential(*(layers[i] for i in split_into_stages(sizes, pp)[pipe_group.rank]))
    params = [p for _, p in stage.named_parameters()]
    grads = [g for _, g in stage.named_grads()]
    optimizer = AdamW(lr=args.lr, weight_decay=0.01)
    denom = args.batch * args.context

    def loss_fn(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return softmax_cross_entropy(logits, targets, denom=denom)

    pipe = PipelineStage(
        stage,
        pipe_group,
        PipelineParallelConfig(pp, args.micro_batches, "1f1b"),
        loss=loss_fn,
        data_parallel=replicas,
    )
    draw = np.random.default_rng(args.seed + 1)
    mine = np.array_split(np.arange(args.batch), replicas.size)[replicas.rank]
    began, loss = time.perf_counter(), float("nan")
    for step in range(args.steps):
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        ids, targets = windows(train, starts, args.context)
        lr = warmup_cosine(step, base_lr=args.lr, warmup=100, total=args.steps, min_lr=args.lr / 10)
        stage.zero_grad()
        part = await pipe.step(ids, targets)
        optimizer.step(params, grads, lr=lr)
        last = await pipe_group.broadcast_object(part, root=pp - 1)  # the last stage's loss
        loss = float((await replicas.all_reduce(np.array([last])))[0])
        await log.step(step + 1, samples=args.batch, loss=loss, lr=lr)
    elapsed = time.perf_counter() - began
    return {
        "steps": args.steps,
        "workers": pg.world_size,
        "stages": pp,
        "micro_batches": args.micro_batches,
        "time_s": round(elapsed, 1),
        "train_loss": round(loss, 4),
        "tokens_per_s": round(args.steps * args.batch * args.context / elapsed),
    }
