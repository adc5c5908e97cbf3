"""Digits trained without FSDP: used by ``digits.py --aggregator allreduce|ps``.

Every rank holds the whole model and computes the gradient of its slice of each global
batch; an aggregator averages the gradients (all-reduce, optionally compressed with
``--compress``, or a parameter server on rank 0) and every rank applies the same AdamW
step. The summary reports the gradient bytes each rank sent.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import shardwire.worker as sw
from shardwire.worker.nn import Module, softmax_cross_entropy
from shardwire.worker.optim import AdamW, warmup_cosine
from shardwire.worker.runtime.runlog import RunLog
from shardwire.worker.training import compression
from shardwire.worker.training.aggregation import (
    AllReduceAggregator,
    ParameterServer,
    distributed_train_step,
)


async def train_aggregated(
    args: argparse.Namespace, pg: sw.ProcessGroup, data: tuple, model: Module
) -> None:
    from digits import accuracy  # the sibling example's evaluation

    x_train, y_train, x_test, y_test = data
    if args.aggregator == "ps":
        aggregator: AllReduceAggregator | ParameterServer = ParameterServer(pg, server=0)
    else:
        aggregator = AllReduceAggregator(pg, codec=compression.parse(args.compress))
    optimizer = AdamW(lr=args.lr, weight_decay=1e-4)
    await aggregator.broadcast_params([p for _, p in model.named_parameters()])
    name = f"digits-{args.aggregator}-{args.compress.replace(':', '')}-seed{args.seed}"
    log = RunLog(
        pg,
        Path(args.run_dir or f"runs/{name}"),
        args.steps,
        every=args.log_every,
        next_free=args.run_dir is None,
    )
    draw = np.random.default_rng(args.seed + 1)
    mine = np.array_split(np.arange(args.batch), pg.world_size)[pg.rank]
    start, last = time.perf_counter(), float("nan")
    for step in range(args.steps):
        batch = draw.choice(len(x_train), args.batch, replace=False)[mine]
        lr = warmup_cosine(step, base_lr=args.lr, warmup=args.steps // 10, total=args.steps)
        loss = await distributed_train_step(
            model,
            (x_train[batch], y_train[batch]),
            softmax_cross_entropy,  # the mean over this rank's rows; the ranks' mean
            aggregator,
            optimizer,
            lr=lr,
        )
        last = float((await pg.all_reduce(np.array([loss])))[0]) / pg.world_size
        metrics = {"loss": last, "lr": lr}
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            metrics["accuracy"] = await accuracy(model, pg, x_test, y_test)
        await log.step(step + 1, samples=args.batch, **metrics)
    elapsed = time.perf_counter() - start
    sent = await pg.all_gather_object(aggregator.wire_bytes)
    log.finish(
        {
            "aggregator": args.aggregator,
            "compress": args.compress,
            "workers": pg.world_size,
            "steps": args.steps,
            "time_s": round(elapsed, 2),
            "step_ms": round(elapsed / args.steps * 1e3, 2),
            "final_loss": round(last, 5),
            "held_out_accuracy": round(await accuracy(model, pg, x_test, y_test), 4),
            "grad_MiB_sent_per_rank": [round(b / 2**20, 3) for b in sent],
            "run_dir": str(log.run_dir),
        }
    )
