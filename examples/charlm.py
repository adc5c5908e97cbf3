"""A character-level transformer language model on the English text that ships with
every CPython (the ``pydoc_data.topics`` help pages), trained with FULL_SHARD and
prefetch. Reports held-out loss in nats per character and prints a generated sample.

    shardwire launch --standalone --nproc-per-node 4 examples/charlm.py [--minutes 10]

``--tp N`` splits every block's attention heads and MLP over groups of N ranks (tensor
parallel) and runs FSDP across those groups (2-D parallelism); gradient clipping is off
then, since the global norm would need the tensor-parallel shards summed once.
``--pp N --micro-batches M`` instead runs pipelines of N stages (see lm_pipeline.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import shardwire.worker as sw
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, by_type, latest_checkpoint
from shardwire.worker.nn import Block, Module, TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.parallel import ParallelBlock
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runlog import RunLog


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
    starts = np.arange(batches * batch) * ((len(data) - context - 1) // (batches * batch))
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


async def build(args: argparse.Namespace, pg: sw.ProcessGroup, *, vocab: int):
    """The FSDP-wrapped model and the group that splits the batch (every rank, or with
    ``--tp`` the ranks holding the same tensor-parallel slice)."""
    block: Callable[..., Module] = Block
    dp: Group = pg  # the ranks that split the batch (FSDP's group)
    if args.tp > 1:  # tensor parallel inside groups of args.tp ranks, FSDP across them
        tp = pg.node_group(local_world_size=args.tp)
        dp = pg.cross_node_group(local_world_size=args.tp)
        block = functools.partial(ParallelBlock, group=tp)
        if ckpt := args.checkpoint_dir:  # each tensor-parallel slice saves its own
            args.checkpoint_dir = str(Path(ckpt) / f"tp-{tp.rank}-of-{tp.size}")
    model = TransformerLM(
        vocab=vocab,
        dim=args.dim,
        heads=args.heads,
        layers=args.layers,
        context=args.context,
        rng=np.random.default_rng(args.seed),
        dtype=np.float32,
        block=block,
    )
    fsdp = await FSDP.create(
        model,
        dp,
        strategy="full_shard",
        prefetch=True,
        optimizer=AdamW(lr=args.lr, weight_decay=0.01),
        policy=by_type(Block),  # ParallelBlock is a Block
    )
    return fsdp, dp


async def _pipelined(args: argparse.Namespace, pg: sw.ProcessGroup, train, vocab: int) -> None:
    from lm_pipeline import train_pipeline  # beside this script

    run_dir = Path(args.run_dir or f"runs/charlm-pp{args.pp}-seed{args.seed}")
    log = RunLog(pg, run_dir, args.steps, every=args.log_every, next_free=args.run_dir is None)
    log.finish(await train_pipeline(args, pg, train, vocab, log))


async def main(args: argparse.Namespace) -> None:
    async with sw.init() as pg:
        data, chars = await asyncio.to_thread(corpus)  # blocking work stays off the loop
        cut = int(len(data) * 0.9)
        train, held = data[:cut], data[cut:]
        if args.pp > 1:
            await _pipelined(args, pg, train, len(chars))
            return
        fsdp, dp = await build(args, pg, vocab=len(chars))
        draw = np.random.default_rng(args.seed + 1)  # the data order
        step, loss, saving = 0, float("nan"), None
        ckpt = args.checkpoint_dir
        if ckpt and await asyncio.to_thread(latest_checkpoint, Path(ckpt)) is not None:
            resumed = await fsdp.load(ckpt, rngs={"draw": draw})  # and the dropout streams
            step, loss = resumed.step, resumed.extra["loss"]
        log = RunLog(
            pg,
            Path(args.run_dir or f"runs/charlm-seed{args.seed}"),
            args.steps,
            every=args.log_every,
            next_free=args.run_dir is None,
            resume_from=step or None,
        )
        mine = np.array_split(np.arange(args.batch), dp.size)[dp.rank]
        deadline = time.monotonic() + args.minutes * 60
        start, first = time.perf_counter(), step
        while step < args.steps:
            starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
            ids, targets = windows(train, starts, args.context)
            lr = warmup_cosine(
                step, base_lr=args.lr, warmup=100, total=args.steps, min_lr=args.lr / 10
            )
            fsdp.zero_grad()
            logits = await fsdp.forward(ids)
            part, dlogits = softmax_cross_entropy(logits, targets, denom=args.batch * args.context)
            await fsdp.backward(dlogits)
            if args.tp == 1:
                await fsdp.clip_grad_norm(1.0)
            await fsdp.step(lr=lr)
            step += 1
            loss = float((await dp.all_reduce(np.array([part])))[0])
            metrics = {"loss": loss, "lr": lr}
            if step % args.log_every == 0:
                metrics["held_out"] = await held_out_loss(fsdp, dp, held, context=args.context)
            await log.step(step, samples=args.batch, **metrics)
            if ckpt and step % args.save_every == 0:
                saving = await fsdp.save(
                    ckpt, step=step, extra={"loss": loss}, rngs={"draw": draw}, blocking=False
                )
            # every rank agrees to stop, so all of them leave the loop at the same step
            out_of_time = time.monotonic() > deadline
            if (await pg.all_reduce(np.array([out_of_time], np.int64)))[0]:
                log.total_steps = step
                break
        if saving is not None:
            await saving.wait()
        elapsed = time.perf_counter() - start
        held_loss = await held_out_loss(fsdp, dp, held, context=args.context)
        text = await sample(
            fsdp, chars, "The ", length=args.sample, context=args.context, seed=args.seed
        )
        log.finish(
            {
                "steps": step,
                "workers": pg.world_size,
                "time_s": round(elapsed, 1),
                "train_loss": round(loss, 4),
                "held_out_nats_per_char": round(held_loss, 4),
                "tokens_per_s": round((step - first) * args.batch * args.context / elapsed),
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
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel group size (1: off)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages per pipeline (1: off)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches with --pp")
    p.add_argument("--sample", type=int, default=200, help="characters to generate")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--run-dir")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; resume from the latest")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    return p.parse_args()


if __name__ == "__main__":
    sw.run(main(parse()))
