"""A small model, data and the single-process reference every FSDP test compares to."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np

from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, Strategy, by_type
from shardwire.worker.nn import Block, TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.module import Module
from shardwire.worker.nn.parallel import ColumnParallelLinear, RowParallelLinear
from shardwire.worker.optim import SGD, AdamW
from tests.worker.transport.fabric import WORLDS

GLOBAL_BATCH = 12
STEPS = 5
SEQ = 5


def make_model() -> TransformerLM:
    return TransformerLM(
        vocab=11, dim=8, heads=2, layers=3, context=6, rng=np.random.default_rng(42)
    )


def tp_slices(model: Module, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Single-process arrays by name, cut the way ``model``'s tensor-parallel layers cut
    them on this rank (the others as they are)."""
    out = dict(full)
    for path, module in model.named_modules():
        if isinstance(module, ColumnParallelLinear):
            a, b = module.span
            blocks = full[f"{path}.weight"].shape[0] // sum(module.splits)
            per = full[f"{path}.weight"].shape[0] // blocks
            rows = np.concatenate([np.arange(k * per + a, k * per + b) for k in range(blocks)])
            for name in ("weight", "bias"):
                out[f"{path}.{name}"] = full[f"{path}.{name}"][rows]
        elif isinstance(module, RowParallelLinear):
            a, b = module.span
            out[f"{path}.weight"] = full[f"{path}.weight"][:, a:b]
    return out


def make_optimizer(kind: str):
    if kind == "sgd":
        return SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
    return AdamW(lr=0.01, weight_decay=0.01)


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(0, 11, (GLOBAL_BATCH, SEQ))
    return ids, np.roll(ids, -1, axis=1)


def reference(kind: str, *, micro: int = 1, clip: float | None = None) -> dict:
    """Single-process training on the whole global batch."""
    model = make_model()
    opt = make_optimizer(kind)
    names = [n for n, _ in model.named_parameters()]
    norms = []
    for step in range(STEPS):
        ids, targets = batch(step)
        model.zero_grad()
        for part in np.array_split(np.arange(GLOBAL_BATCH), micro):
            _, dlogits = softmax_cross_entropy(
                model(ids[part]), targets[part], denom=GLOBAL_BATCH * SEQ
            )
            model.backward(dlogits)
        params = dict(model.named_parameters())
        grads = dict(model.named_grads())
        if clip is not None:
            norm = float(np.sqrt(sum((grads[n] ** 2).sum() for n in names)))
            norms.append(norm)
            if norm > clip:
                for n in names:
                    grads[n] *= clip / (norm + 1e-6)
        opt.step([params[n] for n in names], [grads[n] for n in names])
    state = {n: p.copy() for n, p in model.named_parameters()}
    return {"params": state, "norms": norms}


async def train_rank(
    fsdp: FSDP,
    rank: int,
    world: int,
    *,
    micro: int = 1,
    clip: float | None = None,
    steps: range = range(STEPS),
) -> list[float]:
    norms = []
    rows = np.array_split(np.arange(GLOBAL_BATCH), world)[rank]
    for step in steps:
        ids, targets = batch(step)
        fsdp.zero_grad()
        parts = np.array_split(rows, micro)
        for i, part in enumerate(parts):
            ctx = fsdp.no_sync() if i < len(parts) - 1 else contextlib.nullcontext()
            with ctx:
                logits = await fsdp.forward(ids[part])
                _, dlogits = softmax_cross_entropy(logits, targets[part], denom=GLOBAL_BATCH * SEQ)
                await fsdp.backward(dlogits)
        if clip is not None:
            norms.append(await fsdp.clip_grad_norm(clip))
        await fsdp.step()
    return norms


@contextlib.asynccontextmanager
async def fsdp_world(
    world: int,
    strategy: Strategy,
    kind: str,
    *,
    transport: str = "memory",
    prefetch: bool = True,
    shard_size: int | None = None,
    **options: object,
) -> AsyncIterator[list[FSDP]]:
    async with WORLDS[transport](world, timeout=60) as transports:
        groups = [Group(t, timeout=60) for t in transports]
        wrapped = await asyncio.gather(
            *(
                FSDP.create(
                    make_model(),
                    g,
                    strategy=strategy,
                    optimizer=make_optimizer(kind),
                    policy=by_type(Block),
                    prefetch=prefetch,
                    shard_size=shard_size,
                    **options,
                )
                for g in groups
            )
        )
        try:
            yield list(wrapped)
        finally:
            await close_all(wrapped, groups)


async def close_all(ranks: list[FSDP], groups: list[Group]) -> None:
    """Close every rank's FSDP, then its group."""
    for f in ranks:
        await f.aclose()
    for g in groups:
        await g.aclose()


def assert_follows_oracle(models: list[Module], states: list[dict], full: dict) -> None:
    """Each rank's full parameters are the single-process ones, cut as its model cuts them
    (see :func:`tp_slices`), to 1e-10."""
    for model, state in zip(models, states, strict=True):
        expected = tp_slices(model, full)
        assert state.keys() == expected.keys()
        for name, value in state.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-10, err_msg=name)
