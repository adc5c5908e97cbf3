"""Handwritten digits (the 8x8 set that ships inside scikit-learn) with an MLP, trained
with FSDP on every rank of the job.

    shardwire launch --standalone --nproc-per-node 4 examples/digits.py [--strategy ...]

Each step draws one global batch (the same seeded draw on every rank), each rank takes
its slice, and the loss is averaged over the global batch, so the run computes exactly
what one process would on the whole batch. Held-out accuracy is reported at the end;
the run directory gets metrics.jsonl and summary.json.

With ``--checkpoint-dir DIR`` the run saves a checkpoint every ``--save-every`` steps (in
the background) and, started again with the same command, resumes from the latest one:
the losses and the final model are exactly those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import digitset  # beside this script
import numpy as np
from outer import Replicas, add_arguments  # beside this script
from recovery import add_copy_argument, peer_copies, records_from, restore

import shardwire.worker as sw
from shardwire.worker.fsdp import FSDP, PeerCopies, Strategy, by_type
from shardwire.worker.nn import Linear, Module, ReLU, Sequential, softmax_cross_entropy
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runtime.runlog import RunLog
from shardwire.worker.training import compression


def load(seed: int, test_fraction: float = 0.2):
    x, y = digitset.digits()
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * (1 - test_fraction))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def make_model(hidden: int, seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(64, hidden, rng=rng, dtype=np.float32),
        ReLU(),
        Linear(hidden, hidden, rng=rng, dtype=np.float32),
        ReLU(),
        Linear(hidden, 10, rng=rng, dtype=np.float32),
    )


async def accuracy(fsdp: FSDP | Module, pg: sw.ProcessGroup, x: np.ndarray, y: np.ndarray) -> float:
    """Held-out accuracy: each rank scores a slice, the counts are summed."""
    rows = np.array_split(np.arange(len(x)), pg.world_size)[pg.rank]
    if isinstance(fsdp, FSDP):
        fsdp.model.eval()
        logits = await fsdp.forward(x[rows])
        fsdp.model.train()
    else:
        logits = await asyncio.to_thread(fsdp.eval().forward, x[rows])
        fsdp.train()
    correct = np.array([int((logits.argmax(axis=1) == y[rows]).sum()), len(rows)])
    total = await pg.all_reduce(correct)
    return float(total[0] / total[1])


async def main(args: argparse.Namespace) -> None:
    session = sw.init()
    async with session as pg:
        # Reading the data set (importing scikit-learn, the first time) blocks for
        # seconds on a busy machine; a thread keeps the event loop free meanwhile.
        data = await asyncio.to_thread(load, args.seed)
        if args.aggregator:
            from aggregated import train_aggregated  # beside this script

            await train_aggregated(args, pg, data, make_model(args.hidden, args.seed))
            return
        # --copy-every K: each rank's state is copied to another rank's memory every K
        # steps; a re-formed job restores from those copies, not from disk (and under live
        # recovery a rank sent SIGTERM hands its state over at the next copy step, then
        # leaves: its replacement goes on from there)
        copies = peer_copies(args, pg, session)
        # --recovery live: when a rank fails, the survivors re-form in their processes, a
        # new process replaces the failed rank, and train runs again on the new group
        # from the peer copies (or the checkpoint, as a relaunched job would)
        await session.recovering(lambda group: train(args, group, data, copies))


async def train(
    args: argparse.Namespace, pg: sw.ProcessGroup, data: tuple, copies: PeerCopies | None
) -> None:
    """Train on ``pg`` from the latest checkpoint (if any) to the last step."""
    replicas = Replicas(args, pg)  # one of every rank, or DiLoCo's (--diloco)
    fsdp = await FSDP.create(
        make_model(args.hidden, args.seed),
        replicas.inner,
        strategy=args.strategy,
        optimizer=AdamW(lr=args.lr, weight_decay=1e-4),
        policy=by_type(Linear),
        compression=compression.parse(args.compress),
    )
    try:
        await _steps(args, pg, data, fsdp, replicas, copies=copies)
    finally:
        await fsdp.aclose()  # a failure may leave reductions in flight


async def _steps(
    args: argparse.Namespace,
    pg: sw.ProcessGroup,
    data: tuple,
    fsdp: FSDP,
    replicas: Replicas,
    *,
    copies: PeerCopies | None,
) -> None:
    x_train, y_train, x_test, y_test = data
    await replicas.start(fsdp, copies)
    run_dir = Path(args.run_dir or f"runs/digits-{args.strategy}-seed{args.seed}")
    draw = np.random.default_rng(args.seed + 1)  # the data order
    first, last_loss, saving = 0, float("nan"), None
    ckpt = args.checkpoint_dir and replicas.checkpoints(args.checkpoint_dir)
    resumed = await restore(fsdp, copies, ckpt, {"draw": draw})
    if resumed is not None:
        first, last_loss = resumed.step, resumed.extra["loss"]
        replicas.resume(args.checkpoint_dir, resumed)
    log = RunLog(
        pg,
        run_dir,
        args.steps,
        every=args.log_every,
        next_free=args.run_dir is None,
        resume_from=records_from(first, pg),
    )
    mine, share = replicas.rows(args.batch, fsdp.group)
    held = replicas.held(fsdp)  # for a chaos plan's checks; read only under one
    start = time.perf_counter()
    for step in range(first, args.steps):
        with sw.span("data"):  # on the rank's timeline when traced (--trace)
            batch = draw.choice(len(x_train), args.batch, replace=False)[mine]
        lr = warmup_cosine(step, base_lr=args.lr, warmup=args.steps // 10, total=args.steps)
        fsdp.zero_grad()
        logits = await fsdp.forward(x_train[batch])
        loss, dlogits = softmax_cross_entropy(logits, y_train[batch], denom=share)
        await fsdp.backward(dlogits)
        await fsdp.step(lr=lr)
        await replicas.step()  # DiLoCo's outer sync, when one is due
        # every rank's share of the global batch's mean loss
        total = await pg.all_reduce(np.array([loss * (share / args.batch)]))
        last_loss = float(total[0])
        metrics = {"loss": last_loss, "lr": lr}
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            metrics["accuracy"] = await accuracy(fsdp, pg, x_test, y_test)
        await log.step(step + 1, samples=args.batch, read=batch, held=held, **metrics)
        if ckpt and (step + 1) % args.save_every == 0:
            saving = await fsdp.save(
                ckpt,
                step=step + 1,
                extra={"loss": last_loss},
                rngs={"draw": draw},
                keep=args.keep,
                blocking=False,  # written while training goes on
            )
            await replicas.save(args.checkpoint_dir, step + 1, args.keep)
        if copies is not None:
            await copies.save(fsdp, step + 1, rngs={"draw": draw}, extra={"loss": last_loss})
    if saving is not None:
        await saving.wait()
    await replicas.finish()  # DiLoCo: every replica ends with the global model
    elapsed = time.perf_counter() - start
    acc = await accuracy(fsdp, pg, x_test, y_test)
    memory = await pg.all_gather_object(sum(fsdp.memory_stats()["held"].values()))
    stats = pg.transport.stats
    traffic = await pg.all_gather_object(stats.bytes_sent + stats.bytes_received)
    log.finish(
        {
            "strategy": args.strategy,
            "workers": pg.world_size,
            "steps": args.steps,
            "seed": args.seed,
            "time_s": round(elapsed, 2),
            "samples_per_s": round((args.steps - first) * args.batch / elapsed, 1),
            "final_loss": round(last_loss, 5),
            "held_out_accuracy": round(acc, 4),
            "comm_MiB_per_rank": [round(t / 2**20, 2) for t in traffic],
            "memory_MiB_per_rank": [round(m / 2**20, 3) for m in memory],
            "run_dir": str(log.run_dir),
            **replicas.summary(),
        }
    )


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="full_shard", choices=[s.value for s in Strategy])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--run-dir", help="default runs/digits-<strategy>-seed<seed>")
    p.add_argument("--checkpoint-dir", help="save checkpoints here; resume from the latest")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    add_copy_argument(p)
    p.add_argument(
        "--aggregator",
        choices=["allreduce", "ps"],
        help="train without FSDP: average gradients by all-reduce or a parameter server",
    )
    p.add_argument(
        "--compress",
        default="none",
        help="gradient compression: none, fp16, int8, int4 or topk:RATIO (with --aggregator "
        "allreduce or --strategy no_shard)",
    )
    add_arguments(p)
    args = p.parse_args()
    if args.diloco and args.aggregator:
        p.error("--diloco trains with FSDP inside each replica; drop --aggregator")
    if args.copy_every and args.aggregator:
        p.error("--copy-every copies FSDP state; drop --aggregator")
    if args.compress != "none" and args.aggregator == "ps":
        p.error("--compress works with --aggregator allreduce or --strategy no_shard")
    if args.compress != "none" and not args.aggregator and args.strategy != "no_shard":
        p.error("--compress with FSDP needs --strategy no_shard")
    return args


if __name__ == "__main__":
    sw.run(main(parse()))
