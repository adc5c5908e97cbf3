"""Pipeline-parallel training of the character model: used by ``charlm.py --pp N``.

The mesh's pipelines are N ranks each: the model's layers (embeddings, the blocks, the
head) are split into N contiguous stages balanced by parameter count, the batch into
``--micro-batches`` micro-batches that flow through them under the 1F1B schedule. With
``--tp`` each stage's blocks are split over their tensor-parallel ranks as well. Ranks
holding the same part of the model shard it with FSDP (``--offload`` as in the plain
run), the gradients are clipped at the whole model's norm and AdamW steps on the shards.
A stage's parameters carry the whole model's names, so ``--checkpoint-dir`` saves
checkpoints that resume under any other layout, pipelined or not.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import shardwire.worker as sw
from shardwire.worker.fsdp import FSDP, Offload, PeerCopies, by_type
from shardwire.worker.nn import Block, softmax_cross_entropy
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


async def build_stage(args: argparse.Namespace, mesh: sw.Mesh, *, vocab: int) -> FSDP:
    """This rank's stage of the model, sharded with FSDP over its data-parallel ranks."""
    from charlm import make_model  # the sibling example's model

    model = make_model(args, mesh, vocab=vocab)
    layers = model.pipeline_layers()
    # whole layers' sizes (a tensor-parallel slice's, summed): every slice splits alike
    sizes = [sum(p.size for _, p in layer.named_parameters()) for layer in layers]
    sizes = (await mesh.tp.all_reduce(np.array(sizes, np.float64))).tolist()
    stage = model.pipeline_stage(split_into_stages(sizes, args.pp)[mesh.coords.stage])
    return await FSDP.create(
        stage,
        mesh,
        strategy="full_shard",
        optimizer=AdamW(lr=args.lr, weight_decay=0.01),
        policy=by_type(Block),  # ParallelBlock is a Block
        offload=Offload() if args.offload else None,
    )


async def train_pipeline(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    mesh: sw.Mesh,
    data: tuple,
    copies: PeerCopies | None = None,
) -> None:
    """Train for ``args.steps`` steps (or ``args.minutes``), resuming from the peers'
    copies of a re-formed job or the latest checkpoint in ``--checkpoint-dir``; logs and
    summarises as the plain run does."""
    from charlm import resume  # the sibling example's resumption

    train, held, vocab = data
    pp = args.pp
    fsdp = await build_stage(args, mesh, vocab=vocab)
    denom = args.batch * args.context

    def loss_fn(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return softmax_cross_entropy(logits, targets, denom=denom)

    config = PipelineParallelConfig(pp, args.micro_batches, "1f1b")
    pipe = PipelineStage(fsdp, mesh, config, loss=loss_fn)
    draw = np.random.default_rng(args.seed + 1)  # the data order, as in the FSDP run
    try:
        step, loss, log = await resume(
            args, pg, fsdp, draw, f"runs/charlm-pp{pp}-seed{args.seed}", copies=copies
        )
        began, first = time.perf_counter(), step
        step, loss = await _steps(
            args,
            pg,
            mesh,
            pipe,
            fsdp,
            data=(train, held),
            draw=draw,
            log=log,
            step=step,
            copies=copies,
        )
    except BaseException:
        await fsdp.aclose()  # a failure may leave reductions in flight
        raise
    elapsed = time.perf_counter() - began
    held_loss = await held_out_loss(pipe, mesh, held, context=args.context)
    offloaded = sum(fsdp.memory_stats()["offloaded"].values())
    await fsdp.aclose()
    log.finish(
        {
            "steps": step,
            "workers": pg.world_size,
            "layout": {"dp": mesh.dp.size, "pp": pp, "tp": args.tp},
            "micro_batches": args.micro_batches,
            "offloaded_bytes": offloaded,
            "time_s": round(elapsed, 1),
            "train_loss": round(loss, 4),
            "held_out_nats_per_char": round(held_loss, 4),
            "tokens_per_s": round((step - first) * args.batch * args.context / elapsed),
        }
    )


async def _steps(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    mesh: sw.Mesh,
    pipe: PipelineStage,
    fsdp: FSDP,
    *,
    data: tuple,
    draw: np.random.Generator,
    log: RunLog,
    step: int,
    copies: PeerCopies | None,
) -> tuple[int, float]:
    """Train from ``step`` to the end (or ``args.minutes``); the last step and loss
    (each step copied to a peer's memory with ``copies``)."""
    from charlm import windows  # the sibling example's data

    train, held = data
    ckpt, saving, loss = args.checkpoint_dir, None, float("nan")
    mine = np.array_split(np.arange(args.batch), mesh.dp.size)[mesh.dp.rank]
    deadline = time.monotonic() + args.minutes * 60
    while step < args.steps:
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        ids, targets = windows(train, starts, args.context)
        lr = warmup_cosine(step, base_lr=args.lr, warmup=100, total=args.steps, min_lr=args.lr / 10)
        fsdp.zero_grad()
        part = await pipe.step(ids, targets)
        await pipe.clip_grad_norm(1.0)  # the whole model's norm, as the plain run clips
        await fsdp.step(lr=lr)
        step += 1
        loss = await _everywhere(mesh, part or 0.0)
        metrics = {"loss": loss, "lr": lr}
        if step % args.log_every == 0:
            metrics["held_out"] = await held_out_loss(pipe, mesh, held, context=args.context)
        await log.step(step, samples=args.batch, **metrics)
        if ckpt and step % args.save_every == 0:
            saving = await fsdp.save(
                ckpt, step=step, extra={"loss": loss}, rngs={"draw": draw}, blocking=False
            )
        if copies is not None:
            await copies.save(fsdp, step, rngs={"draw": draw}, extra={"loss": loss})
        out_of_time = time.monotonic() > deadline  # every rank stops at the same step
        if (await pg.all_reduce(np.array([out_of_time], np.int64)))[0]:
            log.total_steps = step
            break
    if saving is not None:
        await saving.wait()
    return step, loss
