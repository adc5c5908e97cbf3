"""What the docs' Python samples take as given, and what they must have done.

A sample is a fragment of a training script: it uses names (``pg``, a model, a batch)
that the surrounding script defines. For each sample, by its block name, ``CONTEXTS``
gives a coroutine that builds those names on this rank of a real job and a check of the
names after the sample ran (against numpy where the sample computes something).
``scripts/snippets.py`` runs the samples in a job; ``test_snippets.py`` starts the jobs.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import shardwire.worker as sw
from shardwire.worker.fsdp import FSDP, PeerCopies, by_type
from shardwire.worker.nn import (
    Block,
    Linear,
    ReLU,
    Sequential,
    TransformerLM,
    softmax_cross_entropy,
)
from shardwire.worker.optim import SGD, AdamW

Names = dict[str, Any]
Check = Callable[[Names], None]


def lm(**over: Any) -> TransformerLM:
    """A transformer small enough for a sample, the same on every rank."""
    shape = {"vocab": 16, "dim": 16, "heads": 2, "layers": 2, "context": 8, **over}
    return TransformerLM(rng=np.random.default_rng(0), **shape)


def tokens(
    pg: sw.ProcessGroup, rows: int = 2, *, vocab: int = 16, context: int = 8, part: int = -1
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a batch of token ids and their next tokens: this rank's, or those of data
    part ``part`` (every rank of a tensor-parallel group reads the same)."""
    draw = np.random.default_rng(10 + (pg.rank if part < 0 else part))
    ids = draw.integers(0, vocab, (rows, context + 1))
    return ids[:, :-1], ids[:, 1:]


def _finite(*names: str) -> Check:
    def check(ns: Names) -> None:
        for name in names:
            assert np.isfinite(ns[name]).all(), (name, ns[name])

    return check


async def collectives(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    r, n = pg.rank, pg.world_size
    full = np.arange(16.0).reshape(8, 2) * (r + 1)
    given = {
        "pg": pg,
        "np": np,
        "grads": np.arange(6.0) * (r + 1),
        "full": full,
        "weights": np.full(4, float(r)),
        "params": np.full(2, float(r)),
        "local_rows": np.zeros((r + 2, 3)),
    }
    total = sum(range(1, n + 1))

    def check(ns: Names) -> None:
        np.testing.assert_array_equal(ns["grads"], np.arange(6.0) * total / n)
        summed = np.arange(16.0).reshape(8, 2) * total
        np.testing.assert_array_equal(ns["shard"], np.array_split(summed, n)[r])
        np.testing.assert_array_equal(ns["full"], summed)  # gathered from the shards
        np.testing.assert_array_equal(ns["weights"], np.zeros(4))  # rank 0's
        assert ns["offset"].tolist() == [sum(k + 2 for k in range(r + 1))]
        np.testing.assert_array_equal(ns["params_full"], np.repeat(np.arange(n * 1.0), 2))
        assert ns["node"].size == n  # every rank on this one host

    return given, check


async def fsdp(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    ids, targets = tokens(pg)
    given = {
        "model": lm(),
        "pg": pg,
        "ids": ids,
        "targets": targets,
        "global_batch_tokens": ids.size * pg.world_size,
        "lr": 1e-3,
    }
    return given, _finite("loss")


async def fsdp_offload(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    given = {"model": lm(), "pg": pg, "FSDP": FSDP, "AdamW": AdamW, "by_type": by_type}
    given["Block"] = Block

    def check(ns: Names) -> None:
        assert ns["fsdp"].offload is not None

    return given, check


async def checkpoints(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    model = await FSDP.create(lm(), pg, optimizer=AdamW(lr=1e-3))
    given = {"fsdp": model, "step": 7, "loss": 0.5, "draw": np.random.default_rng(1)}

    def check(ns: Names) -> None:
        # the load waited for the save in flight: the latest is its step
        assert ns["report"].step == 7 and ns["start"] == 8 and ns["loss"] == 0.5
        assert ns["work"].done()

    return given, check


async def aggregation(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    rng = np.random.default_rng(3)
    model = Sequential(Linear(4, 8, rng=rng), ReLU(), Linear(8, 3, rng=rng))
    draw = np.random.default_rng(20 + pg.rank)
    given = {
        "pg": pg,
        "model": model,
        "params": [p for _, p in model.named_parameters()],
        "x": draw.normal(size=(5, 4)),
        "y": draw.integers(0, 3, 5),
        "softmax_cross_entropy": softmax_cross_entropy,
        "optimizer": SGD(lr=0.1),
    }
    return given, _finite("loss")


async def chaos_held_state(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    from shardwire.worker.runtime.runlog import RunLog

    model = await FSDP.create(lm(), pg, optimizer=AdamW(lr=1e-3))
    log = RunLog(pg, Path.cwd() / "runs" / "held", 1, every=1)  # the job runs in a tmp dir
    given = {"log": log, "step": 1, "batch_size": 4, "batch_indices": np.arange(4)}
    given.update(fsdp=model, loss=1.25)

    def check(ns: Names) -> None:
        if pg.rank == 0:
            assert '"loss": 1.25' in (log.run_dir / "metrics.jsonl").read_text()

    return given, check


async def parallelism(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    ids, targets = tokens(pg, 4, vocab=65, context=64, part=pg.rank // 2)  # tp pairs
    given = {"pg": pg, "ids": ids, "targets": targets, "global_tokens": ids.size * 2}
    return given, _finite("norm")


async def pipeline(pg: sw.ProcessGroup) -> tuple[Names, Check]:
    from shardwire.worker.nn.parallel import ParallelBlock

    ids, targets = tokens(pg, 8, vocab=65, context=64, part=0)  # one replica
    given = {
        "pg": pg,
        "ids": ids,
        "targets": targets,
        "global_tokens": ids.size,
        "sw": sw,
        "np": np,
        "partial": partial,
        "ParallelBlock": ParallelBlock,
        "FSDP": FSDP,
        "TransformerLM": TransformerLM,
        "by_type": by_type,
        "AdamW": AdamW,
        "softmax_cross_entropy": softmax_cross_entropy,
        "shape": {"vocab": 65, "dim": 128, "heads": 4, "layers": 4, "context": 64},
    }

    def check(ns: Names) -> None:
        assert np.isfinite(ns["norm"])
        last = ns["mesh"].coords.stage == 1  # the loss is the last stage's
        assert (ns["total"] is not None and np.isfinite(ns["total"])) == last

    return given, check


CONTEXTS: dict[str, Callable[[sw.ProcessGroup], Awaitable[tuple[Names, Check]]]] = {
    "sample-collectives": collectives,
    "sample-fsdp": fsdp,
    "sample-offload": fsdp_offload,
    "sample-checkpoints": checkpoints,
    "sample-aggregation": aggregation,
    "sample-held-state": chaos_held_state,
    "sample-tp": parallelism,
    "sample-pipeline": pipeline,
}


# Samples that start the session themselves (``sw.init()`` inside): given these names,
# run at the top of a worker script; ``then`` is called with the names afterwards.


async def _tiny_train(args: argparse.Namespace, group: sw.ProcessGroup, copies) -> None:
    """What the elastic guide's ``train`` stands for: FSDP on ``group``, restored from
    the copies, a few steps saved to them."""
    model = await FSDP.create(lm(), group, optimizer=AdamW(lr=1e-3))
    try:
        resumed = await copies.restore(model)
        for step in range(resumed.step if resumed else 0, args.steps):
            ids, targets = tokens(group)
            model.zero_grad()
            _, dy = softmax_cross_entropy(await model.forward(ids), targets)
            await model.backward(dy)
            await model.step()
            await copies.save(model, step + 1)
        args.done = True
    finally:
        await model.aclose()


def _elastic() -> Names:
    args = argparse.Namespace(steps=6, done=False)
    return {"sw": sw, "PeerCopies": PeerCopies, "args": args, "train": _tiny_train}


def _elastic_done(ns: Names) -> None:
    assert ns["args"].done


async def _diloco_done(ns: Names) -> None:
    draw = np.random.default_rng(5)
    batches = [(ids[:, :-1], ids[:, 1:]) for ids in draw.integers(0, 16, (4, 2, 9))]
    loss_fn = partial(softmax_cross_entropy, denom=2 * 8)
    await ns["train"](lm(), batches, loss_fn)


async def _torch_done(ns: Names) -> None:
    import torch

    dist = ns["dist"]
    x = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    n = dist.get_world_size()
    assert x.tolist() == [n * (n + 1) / 2] * 3
    dist.destroy_process_group()


SESSIONS: dict[str, tuple[Callable[[], Names], Callable[[Names], Any]]] = {
    "sample-live-recovery": (_elastic, _elastic_done),
    "sample-live-leave": (_elastic, _elastic_done),
    "sample-diloco": (dict, _diloco_done),
    "sample-torch": (dict, _torch_done),
}
