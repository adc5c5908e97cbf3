"""A character-level transformer language model on the English text that ships with
every CPython (the ``pydoc_data.topics`` help pages). Reports held-out loss in nats per
character and prints a generated sample.

    shardwire launch --standalone --nproc-per-node 4 examples/charlm.py [--minutes 10]

The ranks form a mesh of ``--dp`` x ``--pp`` x ``--tp`` (``sw.Mesh``; ``--dp`` defaults
to what the other two leave). ``--tp N`` splits every block's attention heads and MLP
over groups of N ranks; ``--pp N --micro-batches M`` runs pipelines of N stages (see
lm_pipeline.py); the ranks holding the same part of the model shard it with FSDP
(FULL_SHARD; ``--offload`` keeps its shards and optimizer state in memory-mapped
files), and ``--checkpoint-dir``'s checkpoints resume under any other layout. Every
layout starts from the same parameters, sees the same batches and clips the gradients
at a global norm of 1.0, so its loss curve is the plain run's, to float rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from outer import Replicas, add_arguments  # beside this script
from recovery import add_copy_argument, peer_copies, records_from, restore

import shardwire.worker as sw
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, Offload, PeerCopies, by_type
from shardwire.worker.nn import Block, Module, TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.parallel import ParallelBlock
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runtime.runlog import RunLog


def corpus() -> tuple[np.ndarray, list[str]]:
    import pydoc_data.topics

    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int64), chars


def windows(data: np.ndarray, starts: np.ndarray, context: int) -> tuple[np.ndarray, ...]:
    rows = starts[:, None] + np.arange(context + 1)
    chunk = data[rows]
    return chunk[:, :-1], chunk[:, 1:]


def held_out_starts(data: np.ndarray, context: int, count: int = 256) -> np.ndarray:
    """The held-out windows every evaluation uses, spread over the held-out text."""
    return np.arange(count) * ((len(data) - context - 1) // count)


async def held_out_loss(
    fsdp: FSDP,
    pg: Group,
    data: np.ndarray,
    *,
    context: int,
    batches: int = 8,
    batch: int = 32,
) -> float:
    """Mean nats/char over fixed held-out windows (the same ones every evaluation)."""
    starts = held_out_starts(data, context, batches * batch)
    mine = np.array_split(starts, pg.size)[pg.rank]
    fsdp.model.eval()
    total = 0.0
    for part in np.array_split(mine, batches):
        ids, targets = windows(data, part, context)
        loss, _ = softmax_cross_entropy(
            await fsdp.forward(ids), targets, denom=len(starts) * context
        )
        total += loss
    fsdp.model.train()
    return float((await pg.all_reduce(np.array([total])))[0])


async def sample(
    fsdp: FSDP, chars: list[str], prompt: str, *, length: int, context: int, seed: int
) -> str:
    rng = np.random.default_rng(seed)
    index = {c: i for i, c in enumerate(chars)}
    ids = [index.get(c, 0) for c in prompt]
    fsdp.model.eval()
    for _ in range(length):
        logits = (await fsdp.forward(np.array([ids[-context:]])))[0, -1].astype(np.float64)
        p = np.exp((logits - logits.max()) / 0.8)
        ids.append(int(rng.choice(len(chars), p=p / p.sum())))
    fsdp.model.train()
    return "".join(chars[i] for i in ids)


def make_model(args: argparse.Namespace, mesh: sw.Mesh, *, vocab: int) -> TransformerLM:
    """The model, drawn from ``--seed`` alike in every layout (a tensor-parallel layer
    draws the whole weight and keeps its slice)."""
    block: Callable[..., Module] = Block
    if args.tp > 1:
        block = functools.partial(ParallelBlock, group=mesh)
    return TransformerLM(
        vocab=vocab,
        dim=args.dim,
        heads=args.heads,
        layers=args.layers,
        context=args.context,
        rng=np.random.default_rng(args.seed),
        dtype=np.float32,
        block=block,
    )


async def build(args: argparse.Namespace, mesh: sw.Mesh, *, vocab: int) -> FSDP:
    """The model, sharded with FSDP over the mesh's data-parallel ranks (its checkpoints
    resume under any --dp and --tp)."""
    return await FSDP.create(
        make_model(args, mesh, vocab=vocab),
        mesh,
        strategy="full_shard",
        prefetch=True,
        optimizer=AdamW(lr=args.lr, weight_decay=0.01),
        policy=by_type(Block),  # ParallelBlock is a Block
        offload=Offload() if args.offload else None,
    )


async def resume(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    fsdp: FSDP,
    draw,
    run_dir: str,
    *,
    replicas: Replicas | None = None,
    copies: PeerCopies | None = None,
) -> tuple[int, float, RunLog]:
    """The step and loss to go on from (the peers' copies of a re-formed job, else the
    latest checkpoint in --checkpoint-dir, with the data order ``draw`` and the dropout
    streams, and ``replicas``' DiLoCo state; else the start) and the run's log."""
    step, loss = 0, float("nan")
    ckpt = args.checkpoint_dir
    if ckpt and replicas is not None:
        ckpt = replicas.checkpoints(ckpt)
    resumed = await restore(fsdp, copies, ckpt, {"draw": draw})
    if resumed is not None:
        step, loss = resumed.step, resumed.extra["loss"]
        if replicas is not None:
            replicas.resume(args.checkpoint_dir, resumed)
    log = RunLog(
        pg,
        Path(args.run_dir or run_dir),
        args.steps,
        every=args.log_every,
        next_free=args.run_dir is None,
        resume_from=records_from(step, pg),
    )
    return step, loss, log


async def save(args, fsdp: FSDP, replicas: Replicas, *, step: int, loss: float, draw):
    """A checkpoint of this step, written while training goes on (and DiLoCo's state)."""
    saving = await fsdp.save(
        replicas.checkpoints(args.checkpoint_dir),
        step=step,
        extra={"loss": loss},
        rngs={"draw": draw},
        blocking=False,
    )
    await replicas.save(args.checkpoint_dir, step, keep=None)
    return saving


async def main(args: argparse.Namespace) -> None:
    session = sw.init()
    async with session as pg:
        corpus_chars = await asyncio.to_thread(corpus)  # blocking work stays off the loop
        # --copy-every K: each rank's state is copied to another rank's memory every K
        # steps; a re-formed job restores from those copies, not from disk (and under live
        # recovery a rank sent SIGTERM hands its state over at the next copy step, then
        # leaves: its replacement goes on from there)
        copies = peer_copies(args, pg, session)
        # --recovery live: when a rank fails, the survivors re-form in their processes, a
        # new process replaces the failed rank, and training runs again on the new group
        # from the peer copies (or the checkpoint, as a relaunched job would)
        await session.recovering(lambda group: train_lm(args, group, corpus_chars, copies))


async def train_lm(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    corpus_chars: tuple[np.ndarray, list[str]],
    copies: PeerCopies | None,
) -> None:
    """Train on ``pg`` from the peers' copies or the latest checkpoint (if any)."""
    data, chars = corpus_chars
    cut = int(len(data) * 0.9)
    train, held = data[:cut], data[cut:]
    replicas = Replicas(args, pg)  # one of every rank, or DiLoCo's (--diloco)
    mesh = sw.Mesh(replicas.inner, dp=args.dp, pp=args.pp, tp=args.tp)
    if args.pp > 1:
        from lm_pipeline import train_pipeline  # beside this script

        await train_pipeline(args, pg, mesh, (train, held, len(chars)), copies)
        return
    fsdp = await build(args, mesh, vocab=len(chars))
    try:
        data_split = (train, held, chars)
        await _steps(args, pg, mesh, fsdp, data_split, replicas=replicas, copies=copies)
    finally:
        await fsdp.aclose()  # a failure may leave reductions in flight


async def _steps(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    mesh: sw.Mesh,
    fsdp: FSDP,
    data: tuple[np.ndarray, np.ndarray, list[str]],
    *,
    replicas: Replicas,
    copies: PeerCopies | None,
) -> None:
    train, held, chars = data
    await replicas.start(fsdp, copies)
    dp = mesh.dp
    draw = np.random.default_rng(args.seed + 1)  # the data order
    step, loss, log = await resume(
        args,
        pg,
        fsdp,
        draw,
        f"runs/charlm-seed{args.seed}",
        replicas=replicas,
        copies=copies,
    )
    ckpt, saving = args.checkpoint_dir and replicas.checkpoints(args.checkpoint_dir), None
    mine, share = replicas.rows(args.batch, dp)
    holds = replicas.held(fsdp)  # for a chaos plan's checks; read only under one
    deadline = time.monotonic() + args.minutes * 60
    start, first = time.perf_counter(), step
    while step < args.steps:
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        ids, targets = windows(train, starts, args.context)
        lr = warmup_cosine(step, base_lr=args.lr, warmup=100, total=args.steps, min_lr=args.lr / 10)
        fsdp.zero_grad()
        logits = await fsdp.forward(ids)
        part, dlogits = softmax_cross_entropy(logits, targets, denom=share * args.context)
        await fsdp.backward(dlogits)
        await fsdp.clip_grad_norm(1.0)  # the whole model's norm, in every layout
        await fsdp.step(lr=lr)
        await replicas.step()  # DiLoCo's outer sync, when one is due
        step += 1
        loss = float((await dp.all_reduce(np.array([part])))[0])
        metrics = {"loss": loss, "lr": lr}
        if step % args.log_every == 0:
            metrics["held_out"] = await held_out_loss(fsdp, dp, held, context=args.context)
        await log.step(step, samples=args.batch, read=starts, held=holds, **metrics)
        if ckpt and step % args.save_every == 0:
            saving = await save(args, fsdp, replicas, step=step, loss=loss, draw=draw)
        if copies is not None:
            await copies.save(fsdp, step, rngs={"draw": draw}, extra={"loss": loss})
        # every rank agrees to stop, so all of them leave the loop at the same step
        out_of_time = time.monotonic() > deadline
        if (await pg.all_reduce(np.array([out_of_time], np.int64)))[0]:
            log.total_steps = step
            break
    if saving is not None:
        await saving.wait()
    await replicas.finish()  # DiLoCo: every replica ends with the global model
    elapsed = time.perf_counter() - start
    held_loss = await held_out_loss(fsdp, dp, held, context=args.context)
    text = await sample(
        fsdp, chars, "The ", length=args.sample, context=args.context, seed=args.seed
    )
    log.finish(
        {
            "steps": step,
            "workers": pg.world_size,
            "layout": {"dp": args.dp or dp.size, "pp": args.pp, "tp": args.tp},
            "offloaded_bytes": sum(fsdp.memory_stats()["offloaded"].values()),
            "time_s": round(elapsed, 1),
            "train_loss": round(loss, 4),
            "held_out_nats_per_char": round(held_loss, 4),
            "tokens_per_s": round((step - first) * args.batch * args.context / elapsed),
            **replicas.summary(),
        }
    )
    if pg.rank == 0:
        print("sample:", repr(text))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--minutes", type=float, default=10.0, help="stop early after this long")
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, help="data-parallel size (default: what --tp, --pp leave)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel group size (1: off)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per pipeline (1: off)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches with --pp")
    p.add_argument(
        "--offload", action="store_true", help="FSDP shards and optimizer state in mmap files"
    )
    p.add_argument("--sample", type=int, default=200, help="characters to generate")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--run-dir")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; resume from the latest")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    add_copy_argument(p)
    add_arguments(p)
    args = p.parse_args()
    if args.diloco and args.pp > 1:
        p.error("--diloco runs FSDP (and --tp) inside each replica, not pipelines (--pp)")
    return args


if __name__ == "__main__":
    sw.run(main(parse()))
