"""Pipeline stages against single-process gradient accumulation (float64, rtol 1e-10) at
2-4 stages, 1-8 micro-batches, both schedules, both transports; balanced splits; a
stage that dies fails the others."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument, PeerFailed
from shardwire.worker.nn import GELU, Linear, ReLU, Sequential, mse
from shardwire.worker.nn.pipeline import PipelineParallelConfig, PipelineStage, split_into_stages
from tests.worker.collectives.worlds import KINDS, group_world

BATCH = 8
X = np.random.default_rng(1).standard_normal((BATCH, 6))
Y = np.random.default_rng(2).standard_normal((BATCH, 4))


def _model() -> Sequential:
    rng = np.random.default_rng(7)
    return Sequential(
        Linear(6, 9, rng=rng),
        ReLU(),
        Linear(9, 9, rng=rng),
        GELU(),
        Linear(9, 7, rng=rng),
        ReLU(),
        Linear(7, 4, rng=rng),
    )


def _loss(out: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    return mse(out, target, denom=BATCH)  # scaled for the whole batch


def test_stages_are_contiguous_and_balanced() -> None:
    assert split_into_stages([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_into_stages([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    assert split_into_stages([1, 2, 3], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    seven = split_into_stages(7, 3)  # seven equal layers: the heaviest stage holds three
    assert sorted(len(r) for r in seven) == [2, 2, 3]
    assert [r.start for r in seven[1:]] == [r.stop for r in seven[:-1]] and seven[-1].stop == 7
    with pytest.raises(InvalidArgument, match="cannot split 2 layers into 3 stages"):
        split_into_stages([1, 1], 3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 3, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
async def test_a_pipeline_equals_gradient_accumulation(kind, stages, micro, schedule) -> None:
    ref = _model()
    loss_ref, dy = _loss(ref.forward(X), Y)
    ref.backward(dy)
    want = [dict(layer.grads) for layer in ref.children.values()]
    sizes = [sum(p.size for p in layer.params.values()) + 1 for layer in ref.children.values()]
    parts = split_into_stages(sizes, stages)
    config = PipelineParallelConfig(stages, micro, schedule)
    async with group_world(kind, stages) as groups:
        pipes = []
        for g, part in zip(groups, parts, strict=True):
            layers = list(_model().children.values())
            pipes.append(
                PipelineStage(Sequential(*(layers[i] for i in part)), g, config, loss=_loss)
            )
        async with asyncio.timeout(60):
            losses = await asyncio.gather(
                *(p.step(X if p.first else None, Y if p.last else None) for p in pipes)
            )
    assert losses[-1] == pytest.approx(loss_ref, rel=1e-10)
    assert losses[:-1] == [None] * (stages - 1)
    for pipe, part in zip(pipes, parts, strict=True):
        for layer, i in zip(pipe.module.children.values(), part, strict=True):
            for name, grad in layer.grads.items():
                np.testing.assert_allclose(grad, want[i][name], rtol=1e-10, atol=1e-14)


async def test_a_stage_that_dies_fails_the_others() -> None:
    config = PipelineParallelConfig(3, 4, "1f1b")
    async with group_world("memory", 3) as groups:
        layers = list(_model().children.values())
        parts = split_into_stages([1] * len(layers), 3)
        pipes = [
            PipelineStage(Sequential(*(layers[i] for i in part)), g, config, loss=_loss)
            for g, part in zip(groups, parts, strict=True)
        ]
        groups[1].transport.hub.kill(1, "stage 1 died")  # the middle stage never runs
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                pipes[0].step(X), pipes[2].step(targets=Y), return_exceptions=True
            )
    assert all(isinstance(r, PeerFailed) and r.rank == 1 for r in results), results


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stages, chunks, micro", [(2, 2, 2), (2, 2, 8), (3, 2, 6), (2, 3, 4)])
async def test_an_interleaved_pipeline_equals_gradient_accumulation(
    kind, stages, chunks, micro
) -> None:
    ref = _model()
    loss_ref, dy = _loss(ref.forward(X), Y)
    ref.backward(dy)
    want = [dict(layer.grads) for layer in ref.children.values()]
    parts = split_into_stages(len(want), stages * chunks)  # stage g: rank g % p, chunk g // p
    config = PipelineParallelConfig(stages, micro, "interleaved", chunks=chunks)
    async with group_world(kind, stages) as groups:
        pipes, held = [], []
        for g in groups:
            layers = list(_model().children.values())
            mine = [parts[c * stages + g.rank] for c in range(chunks)]
            held.append(mine)
            chunk_modules = [Sequential(*(layers[i] for i in part)) for part in mine]
            pipes.append(PipelineStage(chunk_modules, g, config, loss=_loss))
        async with asyncio.timeout(60):
            losses = await asyncio.gather(
                *(p.step(X if p.first else None, Y if p.last else None) for p in pipes)
            )
            evaluated = await asyncio.gather(
                *(p.evaluate(X if p.first else None, Y if p.last else None) for p in pipes)
            )
    assert losses[-1] == pytest.approx(loss_ref, rel=1e-10)
    assert evaluated[-1] == pytest.approx(loss_ref, rel=1e-10)
    assert losses[:-1] == evaluated[:-1] == [None] * (stages - 1)
    for pipe, mine in zip(pipes, held, strict=True):
        for chunk, part in zip(pipe.chunks, mine, strict=True):
            for layer, i in zip(chunk.children.values(), part, strict=True):
                for name, grad in layer.grads.items():
                    np.testing.assert_allclose(grad, want[i][name], rtol=1e-10, atol=1e-14)


def test_schedules_that_cannot_run_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="multiples of the 2 stages, got 3"):
        PipelineParallelConfig(2, 3, "interleaved", chunks=2)
    with pytest.raises(InvalidArgument, match="at least 2 chunks"):
        PipelineParallelConfig(2, 4, "interleaved")
    with pytest.raises(InvalidArgument, match="2 chunks per rank need the interleaved schedule"):
        PipelineParallelConfig(2, 4, "1f1b", chunks=2)
    with pytest.raises(InvalidArgument, match="at least 2 stages"):
        PipelineParallelConfig(1, 4, "interleaved", chunks=2)


@pytest.mark.parametrize("kind", KINDS)
async def test_pipeline_stages_times_data_parallel_replicas(kind: str) -> None:
    ref = _model()
    _, dy = _loss(ref.forward(X), Y)
    ref.backward(dy)
    want = [dict(layer.grads) for layer in ref.children.values()]
    config = PipelineParallelConfig(2, 2, "1f1b")
    parts = split_into_stages([1] * len(want), 2)
    async with group_world(kind, 4) as groups:  # stages (0, 1) and (2, 3); replicas by stage
        pipes = []
        for g in groups:
            stage_group = g.new_group([0, 1] if g.rank < 2 else [2, 3], name="pipe")
            replicas = g.new_group([g.rank % 2, g.rank % 2 + 2], name="data")
            layers = list(_model().children.values())
            part = parts[stage_group.rank]
            module = Sequential(*(layers[i] for i in part))
            pipes.append(
                PipelineStage(module, stage_group, config, loss=_loss, data_parallel=replicas)
            )
        halves = np.array_split(np.arange(BATCH), 2)
        async with asyncio.timeout(60):
            await asyncio.gather(
                *(
                    p.step(X[halves[r // 2]], Y[halves[r // 2]]) if p.first or p.last else p.step()
                    for r, p in enumerate(pipes)
                )
            )
    for r, pipe in enumerate(pipes):
        for layer, i in zip(pipe.module.children.values(), parts[r % 2], strict=True):
            for name, grad in layer.grads.items():
                np.testing.assert_allclose(grad, want[i][name], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("stages", [2, 3])
async def test_a_language_model_split_into_stages_equals_the_whole(stages: int) -> None:
    """``TransformerLM.pipeline_stage``: each stage's gradients, under the whole model's
    names, are single-process training's; every parameter is in exactly one stage."""
    from shardwire.worker.nn import TransformerLM, softmax_cross_entropy

    def lm() -> TransformerLM:
        return TransformerLM(
            vocab=11, dim=8, heads=2, layers=3, context=6, rng=np.random.default_rng(4)
        )

    ids = np.random.default_rng(5).integers(0, 11, (6, 5))
    targets = np.roll(ids, -1, axis=1)

    def loss(logits, t):
        return softmax_cross_entropy(logits, t, denom=targets.size)

    ref = lm()
    total, dlogits = loss(ref.forward(ids), targets)
    ref.backward(dlogits)
    want = dict(ref.named_grads())
    config = PipelineParallelConfig(stages, 3, "1f1b")
    async with group_world("memory", stages) as groups:
        models = [lm() for _ in groups]
        pipes = []
        for g, model in zip(groups, models, strict=True):
            layers = model.pipeline_layers()
            part = split_into_stages([1.0] * len(layers), stages)[g.rank]
            pipes.append(PipelineStage(model.pipeline_stage(part), g, config, loss=loss))
        async with asyncio.timeout(60):
            losses = await asyncio.gather(*(p.step(ids, targets) for p in pipes))
    assert losses[-1] == pytest.approx(total, rel=1e-10)
    seen: list[str] = []
    for pipe in pipes:
        for name, grad in pipe.module.named_grads():  # named as in the whole model
            np.testing.assert_allclose(grad, want[name], rtol=1e-10, atol=1e-14, err_msg=name)
            seen.append(name)
    assert sorted(seen) == sorted(want)
