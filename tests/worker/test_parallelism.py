"""A mesh lays a group out as data x pipeline x tensor parallelism (tensor-parallel ranks
consecutive, inside a node), and gradient clipping over it computes the one norm
single-process training computes, in every layout: tensor-parallel slices summed,
replicated parameters counted once, every pipeline stage added, FSDP shards summed."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker import Mesh, MeshError
from shardwire.worker.fsdp import FSDP
from shardwire.worker.fsdp.strategy import by_type
from shardwire.worker.nn import TransformerLM, softmax_cross_entropy
from shardwire.worker.nn.module import Sequential
from shardwire.worker.nn.parallel import ParallelBlock
from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage, split_into_stages
from tests.worker.collectives.worlds import group_world, on_all
from tests.worker.fsdp.training import (
    GLOBAL_BATCH,
    batch,
    make_model,
    make_optimizer,
    reference,
    tp_slices,
)

IDS = np.random.default_rng(5).integers(0, 11, (8, 5))
TARGETS = np.roll(IDS, -1, axis=1)


async def test_ranks_are_laid_out_tensor_first_then_data_then_pipeline() -> None:
    async with group_world("memory", 8) as groups:
        meshes = [Mesh(g, dp=2, pp=2, tp=2) for g in groups]
        again = [Mesh(g, pp=2, tp=2) for g in groups]  # dp follows; the groups are reused
    m5 = meshes[5]  # rank 5 = (stage 1 * 2 + replica 0) * 2 + shard 1
    assert (m5.coords.stage, m5.coords.replica, m5.coords.shard) == (1, 0, 1)
    assert m5.tp.ranks == (4, 5) and m5.dp.ranks == (5, 7) and m5.pp.ranks == (1, 5)
    assert again[5].tp is m5.tp and again[5].sizes == (2, 2, 2)
    assert repr(m5) == "Mesh(dp=2, pp=2, tp=2; stage 1, replica 0, shard 1)"


async def test_layouts_that_do_not_fit_are_refused() -> None:
    async with group_world("memory", 4) as groups:
        with pytest.raises(MeshError, match="4 ranks do not split into pp=3 x tp=1"):
            Mesh(groups[0], pp=3)
        with pytest.raises(MeshError, match=r"dp=1 x pp=2 x tp=1 = 2 ranks, but the group has 4"):
            Mesh(groups[0], dp=1, pp=2)
        with pytest.raises(MeshError, match="at least 1"):
            Mesh(groups[0], tp=0)
    async with group_world("mixed", 4) as groups:  # two nodes of two ranks
        with pytest.raises(MeshError, match=r"ranks \[0, 1, 2, 3\] would span nodes"):
            Mesh(groups[0], tp=4)
        meshes = await on_all(groups, lambda g: _mesh_async(g, tp=2))
        assert [m.tp.ranks for m in meshes] == [(0, 1), (0, 1), (2, 3), (2, 3)]


def _threads_for(ranks: int) -> None:
    """Every in-process rank computes in a thread of its own at once (its tensor-parallel
    layers wait there for the others): more threads than asyncio's default pool has on
    a 2-core machine."""
    pool = ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="rank")
    asyncio.get_running_loop().set_default_executor(pool)


async def _mesh_async(group, **sizes) -> Mesh:
    return Mesh(group, **sizes)


def _lm(tp=None) -> TransformerLM:
    block = None if tp is None else functools.partial(ParallelBlock, group=tp)
    extra = {} if block is None else {"block": block}
    return TransformerLM(
        vocab=11, dim=8, heads=4, layers=3, context=6, rng=np.random.default_rng(4), **extra
    )


def _oracle() -> tuple[dict[str, np.ndarray], float]:
    model = _lm()
    _, dlogits = softmax_cross_entropy(model.forward(IDS), TARGETS, denom=TARGETS.size)
    model.backward(dlogits)
    grads = {n: g.copy() for n, g in model.named_grads()}
    return grads, float(np.sqrt(sum((g**2).sum() for g in grads.values())))


@pytest.mark.parametrize(
    "dp, pp, tp",
    [(2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 4, 1), (4, 1, 1), (2, 2, 2), (1, 2, 4), (2, 4, 1)],
)
async def test_clipping_a_pipeline_in_any_layout_equals_one_process(dp, pp, tp) -> None:
    want, norm = _oracle()
    max_norm = norm / 2  # clipping happens
    scale = max_norm / (norm + 1e-6)
    config = PipelineParallelConfig(pp, 2, "1f1b")

    def loss(logits, targets):
        return softmax_cross_entropy(logits, targets, denom=TARGETS.size)

    _threads_for(dp * pp * tp)
    async with group_world("memory", dp * pp * tp) as groups:
        meshes = [Mesh(g, dp=dp, pp=pp, tp=tp) for g in groups]
        models = [_lm(m) if tp > 1 else _lm() for m in meshes]
        pipes = []
        for mesh, model in zip(meshes, models, strict=True):
            layers = model.pipeline_layers()
            part = split_into_stages([1.0] * len(layers), pp)[mesh.coords.stage]
            stage = Sequential(*(layers[i] for i in part))
            pipes.append(PipelineStage(stage, mesh, config, loss=loss))

        async def train(pipe: PipelineStage, mesh: Mesh) -> float:
            rows = np.array_split(np.arange(len(IDS)), dp)[mesh.coords.replica]
            await pipe.step(IDS[rows], TARGETS[rows])
            return await pipe.clip_grad_norm(max_norm)

        async with asyncio.timeout(120):
            norms = await asyncio.gather(*(train(p, m) for p, m in zip(pipes, meshes, strict=True)))
    assert norms == pytest.approx([norm] * len(norms), rel=1e-10)
    for pipe, model in zip(pipes, models, strict=True):
        mine = {id(g) for _, g in pipe.module.named_grads()}
        expected = tp_slices(model, {n: g * scale for n, g in want.items()})
        checked = 0
        for name, grad in model.named_grads():
            if id(grad) in mine:  # this stage's parameters
                np.testing.assert_allclose(grad, expected[name], rtol=1e-10, atol=1e-14)
                checked += 1
        assert checked == len(mine) > 0


@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 1), (1, 2), (4, 2)])
async def test_clipping_fsdp_with_tensor_parallel_equals_one_process(dp: int, tp: int) -> None:
    max_norm = 0.05  # below the model's first gradient norms: every step clips
    want = reference("adam", clip=max_norm)
    _threads_for(dp * tp)
    async with group_world("memory", dp * tp, timeout=60) as groups:
        meshes = [Mesh(g, dp=dp, tp=tp) for g in groups]
        models = [
            TransformerLM(
                vocab=11,
                dim=8,
                heads=2,
                layers=3,
                context=6,
                rng=np.random.default_rng(42),
                block=functools.partial(ParallelBlock, group=m),
            )
            if tp > 1
            else make_model()
            for m in meshes
        ]
        policy = by_type(ParallelBlock)
        wrapped = await asyncio.gather(
            *(
                FSDP.create(model, m, optimizer=make_optimizer("adam"), policy=policy)
                for model, m in zip(models, meshes, strict=True)
            )
        )
        try:

            async def train(fsdp: FSDP, mesh: Mesh) -> list[float]:
                rows = np.array_split(np.arange(GLOBAL_BATCH), dp)[mesh.coords.replica]
                norms = []
                for step in range(5):
                    ids, targets = batch(step)
                    fsdp.zero_grad()
                    logits = await fsdp.forward(ids[rows])
                    _, dlogits = softmax_cross_entropy(logits, targets[rows], denom=ids.size)
                    await fsdp.backward(dlogits)
                    norms.append(await fsdp.clip_grad_norm(max_norm))
                    await fsdp.step()
                return norms

            async with asyncio.timeout(120):
                norms = await asyncio.gather(
                    *(train(f, m) for f, m in zip(wrapped, meshes, strict=True))
                )
            states = await asyncio.gather(*(f.state_dict() for f in wrapped))
        finally:
            for f in wrapped:
                await f.aclose()
    assert min(want["norms"]) > max_norm
    for got in norms:
        np.testing.assert_allclose(got, want["norms"], rtol=1e-10)
    for model, state in zip(models, states, strict=True):
        expected = tp_slices(model, want["params"])
        for name, value in state.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicas", "fsdp"])
@pytest.mark.parametrize(
    "dp, pp, tp", [(2, 2, 2), (2, 2, 1), (1, 2, 2), (1, 4, 1), (2, 4, 1), (4, 2, 1)]
)
async def test_training_on_a_mesh_reaches_the_one_process_parameters(dp, pp, tp, sharded) -> None:
    """Tensor-parallel slices inside pipelines, over replicas (each stage's gradients
    summed over them, or the stage sharded over them with FSDP), 2 x 2 x 2 among the
    layouts: five clipped AdamW steps end at the single-process parameters."""
    max_norm = 0.05
    want = reference("adam", clip=max_norm)
    config = PipelineParallelConfig(pp, 2, "1f1b")

    def loss(logits, targets):
        return softmax_cross_entropy(logits, targets, denom=GLOBAL_BATCH * targets.shape[1])

    _threads_for(dp * pp * tp)
    async with group_world("memory", dp * pp * tp) as groups:
        meshes = [Mesh(g, dp=dp, pp=pp, tp=tp) for g in groups]
        models = [
            TransformerLM(
                vocab=11,
                dim=8,
                heads=2,
                layers=3,
                context=6,
                rng=np.random.default_rng(42),
                block=functools.partial(ParallelBlock, group=m),
            )
            if tp > 1
            else make_model()
            for m in meshes
        ]

        async def train(mesh: Mesh, model: TransformerLM) -> tuple[list[float], dict]:
            layers = model.pipeline_layers()
            part = split_into_stages([1.0] * len(layers), pp)[mesh.coords.stage]
            stage = Sequential(*(layers[i] for i in part))
            whole_names = {id(v): n for n, v in model.named_parameters()}
            names = {n: whole_names[id(v)] for n, v in stage.named_parameters()}  # the same arrays
            optimizer = make_optimizer("adam")
            if sharded:
                fsdp = await FSDP.create(
                    stage, mesh, optimizer=optimizer, policy=by_type(ParallelBlock)
                )
                pipe = PipelineStage(fsdp, mesh, config, loss=loss)
            else:
                pipe = PipelineStage(stage, mesh, config, loss=loss)
                params = [p for _, p in stage.named_parameters()]
                grads = [g for _, g in stage.named_grads()]
            rows = np.array_split(np.arange(GLOBAL_BATCH), dp)[mesh.coords.replica]
            norms = []
            for step in range(5):
                ids, targets = batch(step)
                (fsdp if sharded else stage).zero_grad()
                await pipe.step(ids[rows], targets[rows])
                norms.append(await pipe.clip_grad_norm(max_norm))
                if sharded:
                    await fsdp.step()
                else:
                    optimizer.step(params, grads)
            if not sharded:
                return norms, {names[n]: v.copy() for n, v in stage.named_parameters()}
            async with fsdp.full_params() as whole:
                final = {names[n]: v.copy() for n, v in whole.named_parameters()}
            await fsdp.aclose()
            return norms, final

        async with asyncio.timeout(180):
            results = await asyncio.gather(
                *(train(m, x) for m, x in zip(meshes, models, strict=True))
            )
    for (norms, final), model in zip(results, models, strict=True):
        np.testing.assert_allclose(norms, want["norms"], rtol=1e-10)
        expected = tp_slices(model, want["params"])
        assert len(final) > 0
        for name, value in final.items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-10, atol=1e-10, err_msg=name)
    stages = [set(results[s * dp * tp][1]) for s in range(pp)]  # replica 0, slice 0
    assert sum(map(len, stages)) == len(set().union(*stages)) == len(want["params"])


async def test_a_sharded_stage_must_be_made_over_the_pipelines_mesh() -> None:
    config = PipelineParallelConfig(2, 2, "1f1b")
    async with group_world("memory", 2) as groups:
        meshes = [Mesh(g, pp=2) for g in groups]
        stages = [Sequential(*_lm().pipeline_layers()[:2]) for _ in groups]
        wrapped = await asyncio.gather(  # over the data-parallel group alone: no mesh
            *(
                FSDP.create(s, m.dp, optimizer=make_optimizer("adam"))
                for s, m in zip(stages, meshes, strict=True)
            )
        )
        try:
            with pytest.raises(InvalidArgument, match="over the pipeline's mesh"):
                PipelineStage(wrapped[0], meshes[0], config, loss=softmax_cross_entropy)
        finally:
            for f in wrapped:
                await f.aclose()
