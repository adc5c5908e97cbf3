"""Checkpoints across tensor-parallel layouts: saved under one (dp, tp), resumed under
another (or on another number of ranks), training goes on exactly as the single-process
oracle does, AdamW's moments included; ``consolidate`` assembles the split parameters."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from shardwire.worker import Mesh
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, CheckpointError, Strategy, by_type
from shardwire.worker.fsdp import tools as checkpoint_tools
from shardwire.worker.fsdp.store import read_manifest, resolve
from shardwire.worker.nn import Block, TransformerLM
from shardwire.worker.nn.parallel import ParallelBlock
from tests.worker.transport.fabric import WORLDS

from .training import STEPS, assert_follows_oracle, close_all, make_optimizer, reference, train_rank

SAVED_AT = 3  # steps trained before the save; the rest after the resume


def _model(mesh: Mesh) -> TransformerLM:
    tp = mesh.sizes[2]
    block = Block if tp == 1 else functools.partial(ParallelBlock, group=mesh)
    return TransformerLM(
        vocab=11, dim=8, heads=2, layers=3, context=6, rng=np.random.default_rng(42),
        block=block,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def _layout(world: int, tp: int, strategy: Strategy) -> AsyncIterator[list[FSDP]]:
    async with WORLDS["memory"](world, timeout=60) as transports:
        groups = [Group(t, timeout=60) for t in transports]
        meshes = [Mesh(g, tp=tp) for g in groups]
        wrapped = await asyncio.gather(
            *(
                FSDP.create(
                    _model(m), m, optimizer=make_optimizer("adam"), strategy=strategy,
                    policy=by_type(Block),
                )
                for m in meshes
            )
        )  # fmt: skip
        try:
            yield list(wrapped)
        finally:
            await close_all(wrapped, groups)


async def _train(ranks: list[FSDP], steps: range) -> None:
    await asyncio.gather(*(train_rank(f, f.group.rank, f.group.size, steps=steps) for f in ranks))


@pytest.mark.parametrize(
    "saved, resumed",
    [((4, 2), (4, 1)), ((4, 1), (4, 2)), ((4, 2), (2, 2)), ((4, 2), (4, 2)), ((2, 2), (3, 1))],
    ids=["dp2tp2-dp4", "dp4-dp2tp2", "dp2tp2-tp2", "same", "tp2-dp3"],
)
async def test_resume_under_another_layout_follows_the_oracle(tmp_path, saved, resumed) -> None:
    async with _layout(*saved, Strategy.FULL_SHARD) as ranks:
        await _train(ranks, range(SAVED_AT))
        await asyncio.gather(*(f.save(tmp_path, step=SAVED_AT) for f in ranks))
    manifest = read_manifest(resolve(tmp_path))
    assert manifest["tp"] == saved[1] and manifest["world_size"] == saved[0]
    split = [k for k in manifest["tensors"] if "@tp" in k]
    assert bool(split) == (saved[1] > 1)  # slices only where the model was split
    async with _layout(*resumed, Strategy.FULL_SHARD) as ranks:
        infos = await asyncio.gather(*(f.load(tmp_path) for f in ranks))
        assert {i.step for i in infos} == {SAVED_AT}
        await _train(ranks, range(SAVED_AT, STEPS))
        states = await asyncio.gather(*(f.state_dict() for f in ranks))
        models = [f.model for f in ranks]
    assert_follows_oracle(models, states, reference("adam")["params"])


async def test_consolidate_assembles_split_parameters(tmp_path: Path) -> None:
    async with _layout(4, 2, Strategy.NO_SHARD) as ranks:
        await _train(ranks, range(SAVED_AT))
        await asyncio.gather(*(f.save(tmp_path / "ckpt", step=SAVED_AT) for f in ranks))
    async with _layout(2, 1, Strategy.FULL_SHARD) as ranks:  # the whole model, as loaded
        await asyncio.gather(*(f.load(tmp_path / "ckpt") for f in ranks))
        whole = (await asyncio.gather(*(f.state_dict() for f in ranks)))[0]
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
