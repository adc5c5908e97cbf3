"""Checkpoints across layouts: saved under one (dp, pp, tp), resumed under another (or
on another number of ranks), training goes on exactly as the single-process
oracle does, AdamW's moments included; ``consolidate`` assembles the split parameters."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from shardwire.worker import Mesh
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, CheckpointError, Strategy, by_type
from shardwire.worker.fsdp import tools as checkpoint_tools
from shardwire.worker.fsdp.store import read_manifest, resolve
from shardwire.worker.nn import Block, TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.parallel import ParallelBlock
from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage, split_into_stages
from tests.worker.transport.fabric import WORLDS

from .training import (
    GLOBAL_BATCH,
    SEQ,
    STEPS,
    batch,
    close_all,
    make_optimizer,
    reference,
    tp_slices,
    train_rank,
)

SAVED_AT = 3  # steps trained before the save; the rest after the resume


def _model(mesh: Mesh) -> TransformerLM:
    tp = mesh.sizes[2]
    block = Block if tp == 1 else functools.partial(ParallelBlock, group=mesh)
    return TransformerLM(
        vocab=11,
        dim=8,
        heads=2,
        layers=3,
        context=6,
        rng=np.random.default_rng(42),
        block=block,
    )


@dataclass
class _Rank:
    fsdp: FSDP
    model: TransformerLM  # the whole model this rank's stage is part of
    pipe: PipelineStage | None  # with pipelines


def _loss(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    return softmax_cross_entropy(logits, targets, denom=GLOBAL_BATCH * SEQ)


async def _rank(mesh: Mesh, strategy: Strategy) -> _Rank:
    model = _model(mesh)
    pp = mesh.sizes[1]
    part = split_into_stages(len(model.pipeline_layers()), pp)[mesh.coords.stage]
    stage = model if pp == 1 else model.pipeline_stage(part)
    fsdp = await FSDP.create(
        stage, mesh, optimizer=make_optimizer("adam"), strategy=strategy, policy=by_type(Block)
    )
    config = PipelineParallelConfig(pp, 2, "1f1b")
    return _Rank(fsdp, model, None if pp == 1 else PipelineStage(fsdp, mesh, config, loss=_loss))


@contextlib.asynccontextmanager
async def _layout(
    world: int, pp: int, tp: int, strategy: Strategy = Strategy.FULL_SHARD
) -> AsyncIterator[list[_Rank]]:
    async with WORLDS["memory"](world, timeout=60) as transports:
        groups = [Group(t, timeout=60) for t in transports]
        ranks = await asyncio.gather(*(_rank(Mesh(g, pp=pp, tp=tp), strategy) for g in groups))
        try:
            yield list(ranks)
        finally:
            await close_all([r.fsdp for r in ranks], groups)


async def _train(ranks: list[_Rank], steps: range) -> None:
    async def pipelined(r: _Rank) -> None:
        assert r.pipe is not None and r.fsdp.mesh is not None
        dp = r.fsdp.mesh.dp
        rows = np.array_split(np.arange(GLOBAL_BATCH), dp.size)[dp.rank]
        for step in steps:
            ids, targets = batch(step)
            r.fsdp.zero_grad()
            await r.pipe.step(ids[rows], targets[rows])
            await r.fsdp.step()

    await asyncio.gather(
        *(
            train_rank(r.fsdp, r.fsdp.group.rank, r.fsdp.group.size, steps=steps)
            if r.pipe is None
            else pipelined(r)
            for r in ranks
        )
    )


@pytest.mark.parametrize(
    "saved, resumed",
    [
        ((4, 1, 2), (4, 1, 1)),
        ((4, 1, 1), (4, 1, 2)),
        ((4, 1, 2), (2, 1, 2)),
        ((4, 1, 2), (4, 1, 2)),
        ((2, 1, 2), (3, 1, 1)),
        ((4, 2, 2), (2, 1, 1)),
        ((2, 1, 1), (4, 2, 1)),
        ((4, 2, 1), (4, 2, 2)),
    ],
    ids=[
        "dp2tp2-dp4",
        "dp4-dp2tp2",
        "dp2tp2-tp2",
        "same",
        "tp2-dp3",
        "pp2tp2-dp2",
        "dp2-dp2pp2",
        "dp2pp2-pp2tp2",
    ],
)
async def test_resume_under_another_layout_follows_the_oracle(tmp_path, saved, resumed) -> None:
    async with _layout(*saved) as ranks:
        await _train(ranks, range(SAVED_AT))
        await asyncio.gather(*(r.fsdp.save(tmp_path, step=SAVED_AT) for r in ranks))
    manifest = read_manifest(resolve(tmp_path))
    assert manifest["tp"] == saved[2] and manifest["world_size"] == saved[0]
    split = [k for k in manifest["tensors"] if "@tp" in k]
    assert bool(split) == (saved[2] > 1)  # slices only where the model was split
    async with _layout(*resumed) as ranks:
        infos = await asyncio.gather(*(r.fsdp.load(tmp_path) for r in ranks))
        assert {i.step for i in infos} == {SAVED_AT}
        await _train(ranks, range(SAVED_AT, STEPS))
        states = await asyncio.gather(*(r.fsdp.state_dict() for r in ranks))
    full = reference("adam")["params"]
    seen: set[str] = set()
    for r, state in zip(ranks, states, strict=True):  # a stage's names are the model's
        expected = tp_slices(r.model, full)
        assert state and set(state) <= set(expected)
        seen.update(state)
        for name, value in state.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-10, err_msg=name)
    assert seen == set(full)


async def test_consolidate_assembles_split_parameters(tmp_path: Path) -> None:
    async with _layout(4, 1, 2, Strategy.NO_SHARD) as ranks:
        await _train(ranks, range(SAVED_AT))
        await asyncio.gather(*(r.fsdp.save(tmp_path / "ckpt", step=SAVED_AT) for r in ranks))
    async with _layout(2, 1, 1) as ranks:  # the whole model, as loaded
        await asyncio.gather(*(r.fsdp.load(tmp_path / "ckpt") for r in ranks))
        whole = (await asyncio.gather(*(r.fsdp.state_dict() for r in ranks)))[0]
    path = resolve(tmp_path / "ckpt")
    checkpoint_tools.consolidate(path, read_manifest(path), tmp_path / "model.safetensors")
    written = load_file(str(tmp_path / "model.safetensors"))
    assert written.keys() == whole.keys()
    assert any(v.shape[0] == 24 for k, v in written.items() if k.endswith("qkv.weight"))
    for name, value in whole.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


async def test_a_split_model_without_its_mesh_is_refused(tmp_path: Path) -> None:
    async with WORLDS["memory"](2, timeout=60) as transports:
        groups = [Group(t, timeout=60) for t in transports]
        meshes = [Mesh(g, tp=2) for g in groups]
        models = [_model(m) for m in meshes]
        ranks = await asyncio.gather(
            *(
                FSDP.create(mod, m.dp, optimizer=make_optimizer("adam"))
                for mod, m in zip(models, meshes, strict=True)
            )
        )
        try:
            with pytest.raises(CheckpointError, match="through its mesh"):
                await ranks[0].save(tmp_path, step=1)
        finally:
            await close_all(ranks, groups)
