"""Pipeline-parallel training of the character model: used by ``charlm.py --pp N``.

The mesh's pipelines are N ranks each: the model's layers (embeddings, the blocks, the
head) are split into N contiguous stages balanced by parameter count, the batch into
``--micro-batches`` micro-batches that flow through them under the 1F1B schedule. With
``--tp`` each stage's blocks are split over their tensor-parallel ranks as well. Ranks
holding the same part of the model sum their gradients (pipeline x data parallel), the
gradients are clipped at the whole model's norm and every stage runs AdamW on its own
parameters, as the FSDP run does on its shards.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import shardwire.worker as sw
from shardwire.worker.nn import Sequential, softmax_cross_entropy
from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage, split_into_stages
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runtime.runlog import RunLog


async def held_out_loss(
    pipe: PipelineStage, mesh: sw.Mesh, data: np.ndarray, *, context: int
) -> float:
    """The FSDP run's held-out measure (the same fixed windows), through the pipeline."""
    from charlm import held_out_starts, windows  # the sibling example's data

    starts = held_out_starts(data, context)
    mine = np.array_split(starts, mesh.dp.size)[mesh.dp.rank]
    denom = len(starts) * context

    def loss(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return softmax_cross_entropy(logits, targets, denom=denom)

    total = 0.0
    for part in np.array_split(mine, 8):
        ids, targets = windows(data, part, context)
        total += (await pipe.evaluate(ids, targets, loss=loss)) or 0.0
    return await _everywhere(mesh, total)


async def _everywhere(mesh: sw.Mesh, last_stage_part: float) -> float:
    """A sum the last stage holds for this replica's rows, over every replica, on every
    rank."""
    part = await mesh.pp.broadcast_object(last_stage_part, root=mesh.pp.size - 1)
    return float((await mesh.dp.all_reduce(np.array([part])))[0])


async def train_pipeline(
    args: argparse.Namespace, pg: sw.ProcessGroup, mesh: sw.Mesh, data: tuple, log: RunLog
) -> dict:
    """Train for ``args.steps`` steps (or ``args.minutes``); returns the summary."""
    from charlm import make_model, windows  # the sibling example's model and data

    train, held, vocab = data
    pp = args.pp
    model = make_model(args, mesh, vocab=vocab)
    layers = model.pipeline_layers()
    # whole layers' sizes (a tensor-parallel slice's, summed): every slice splits alike
    sizes = [sum(p.size for _, p in layer.named_parameters()) for layer in layers]
    sizes = (await mesh.tp.all_reduce(np.array(sizes, np.float64))).tolist()
    stage = Sequential(*(layers[i] for i in split_into_stages(sizes, pp)[mesh.coords.stage]))
    params = [p for _, p in stage.named_parameters()]
    grads = [g for _, g in stage.named_grads()]
    optimizer = AdamW(lr=args.lr, weight_decay=0.01)
    denom = args.batch * args.context

    def loss_fn(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return softmax_cross_entropy(logits, targets, denom=denom)

    config = PipelineParallelConfig(pp, args.micro_batches, "1f1b")
    pipe = PipelineStage(stage, mesh, config, loss=loss_fn)
    draw = np.random.default_rng(args.seed + 1)  # the data order, as in the FSDP run
    mine = np.array_split(np.arange(args.batch), mesh.dp.size)[mesh.dp.rank]
    deadline = time.monotonic() + args.minutes * 60
    began, loss, step = time.perf_counter(), float("nan"), 0
    while step < args.steps:
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        ids, targets = windows(train, starts, args.context)
        lr = warmup_cosine(step, base_lr=args.lr, warmup=100, total=args.steps, min_lr=args.lr / 10)
        stage.zero_grad()
        part = await pipe.step(ids, targets)
        await pipe.clip_grad_norm(1.0)  # the whole model's norm, as the FSDP run clips
        optimizer.step(params, grads, lr=lr)
        step += 1
        loss = await _everywhere(mesh, part or 0.0)
        metrics = {"loss": loss, "lr": lr}
        if step % args.log_every == 0:
            metrics["held_out"] = await held_out_loss(pipe, mesh, held, context=args.context)
        await log.step(step, samples=args.batch, **metrics)
        out_of_time = time.monotonic() > deadline  # every rank stops at the same step
        if (await pg.all_reduce(np.array([out_of_time], np.int64)))[0]:
            log.total_steps = step
            break
    elapsed = time.perf_counter() - began
    held_loss = await held_out_loss(pipe, mesh, held, context=args.context)
    return {
        "steps": step,
        "workers": pg.world_size,
        "layout": {"dp": mesh.dp.size, "pp": pp, "tp": args.tp},
        "micro_batches": args.micro_batches,
        "time_s": round(elapsed, 1),
        "train_loss": round(loss, 4),
        "held_out_nats_per_char": round(held_loss, 4),
        "tokens_per_s": round(step * args.batch * args.context / elapsed),
    }
