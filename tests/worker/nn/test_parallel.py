"""Tensor-parallel linears against the single-process Linear (float64, rtol 1e-10): forward,
input gradient and parameter gradients, group sizes 1-4 with uneven splits, both
transports, and the column -> row MLP."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import InvalidState
from shardwire.worker.kernels.segments import bounds
from shardwire.worker.nn import Block, Linear, ReLU, Sequential
from shardwire.worker.nn.parallel import ColumnParallelLinear, ParallelBlock, RowParallelLinear
from tests.worker.collectives.worlds import KINDS, group_world

D_IN, D_OUT = 5, 7  # split unevenly over 2, 3 and 4 ranks
X = np.random.default_rng(3).standard_normal((2, 3, D_IN))
DY = np.random.default_rng(4).standard_normal((2, 3, D_OUT))


def _reference() -> tuple[Linear, np.ndarray, np.ndarray]:
    layer = Linear(D_IN, D_OUT, rng=np.random.default_rng(11))
    layer.params["bias"][:] = np.arange(D_OUT) / 10
    y = layer.forward(X)
    dx = layer.backward(DY)
    return layer, y, dx


async def _on_threads(layers, fn):
    async with asyncio.timeout(60):
        return await asyncio.gather(*(asyncio.to_thread(fn, layer) for layer in layers))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("gather", [True, False])
async def test_column_parallel_linear(kind: str, size: int, gather: bool) -> None:
    ref, y_ref, dx_ref = _reference()
    async with group_world(kind, size) as groups:
        layers = [
            ColumnParallelLinear(
                D_IN, D_OUT, g, rng=np.random.default_rng(11), gather_output=gather
            )
            for g in groups
        ]
        for layer in layers:
            a, b = layer.span
            layer.params["bias"][:] = np.arange(a, b) / 10
        ys = await _on_threads(layers, lambda layer: layer.forward(X))
        dys = [DY if gather else DY[..., slice(*layer.span)] for layer in layers]
        dxs = await asyncio.gather(
            *(asyncio.to_thread(layer.backward, dy) for layer, dy in zip(layers, dys, strict=True))
        )
    for layer, y, dx in zip(layers, ys, dxs, strict=True):
        a, b = layer.span
        np.testing.assert_allclose(y, y_ref if gather else y_ref[..., a:b], rtol=1e-10)
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-10)
        np.testing.assert_allclose(layer.grads["weight"], ref.grads["weight"][a:b], rtol=1e-10)
        np.testing.assert_allclose(layer.grads["bias"], ref.grads["bias"][a:b], rtol=1e-10)
    assert [layer.span for layer in layers] == bounds(D_OUT, size)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("parallel_input", [True, False])
async def test_row_parallel_linear(kind: str, size: int, parallel_input: bool) -> None:
    ref, y_ref, dx_ref = _reference()
    async with group_world(kind, size) as groups:
        layers = [
            RowParallelLinear(
                D_IN, D_OUT, g, rng=np.random.default_rng(11), input_is_parallel=parallel_input
            )
            for g in groups
        ]
        for layer in layers:
            layer.params["bias"][:] = np.arange(D_OUT) / 10
        xs = [X[..., slice(*layer.span)] if parallel_input else X for layer in layers]
        ys = await asyncio.gather(
            *(asyncio.to_thread(layer.forward, x) for layer, x in zip(layers, xs, strict=True))
        )
        dxs = await _on_threads(layers, lambda layer: layer.backward(DY))
    for layer, y, dx in zip(layers, ys, dxs, strict=True):
        a, b = layer.span
        np.testing.assert_allclose(y, y_ref, rtol=1e-10)
        np.testing.assert_allclose(dx, dx_ref[..., a:b] if parallel_input else dx_ref, rtol=1e-10)
        np.testing.assert_allclose(layer.grads["weight"], ref.grads["weight"][:, a:b], rtol=1e-10)
        np.testing.assert_allclose(layer.grads["bias"], ref.grads["bias"], rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [2, 3])
async def test_a_column_then_row_mlp_equals_the_single_process_one(kind: str, size: int) -> None:
    hidden = 11
    rng = np.random.default_rng(5)
    ref = Sequential(Linear(D_IN, hidden, rng=rng), ReLU(), Linear(hidden, D_IN, rng=rng))
    y_ref = ref.forward(X)
    dx_ref = ref.backward(X - 1.0)
    async with group_world(kind, size) as groups:
        models = []
        for g in groups:
            rng = np.random.default_rng(5)
            models.append(
                Sequential(
                    ColumnParallelLinear(D_IN, hidden, g, rng=rng, gather_output=False),
                    ReLU(),
                    RowParallelLinear(hidden, D_IN, g, rng=rng, input_is_parallel=True),
                )
            )
        ys = await _on_threads(models, lambda m: m.forward(X))
        dxs = await _on_threads(models, lambda m: m.backward(X - 1.0))
    for model, y, dx in zip(models, ys, dxs, strict=True):
        np.testing.assert_allclose(y, y_ref, rtol=1e-10)
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-10)
        a, b = model[0].span
        np.testing.assert_allclose(
            model[0].grads["weight"], ref[0].grads["weight"][a:b], rtol=1e-10
        )
        np.testing.assert_allclose(
            model[2].grads["weight"], ref[2].grads["weight"][:, a:b], rtol=1e-10
        )


async def test_calling_on_the_event_loop_is_refused() -> None:
    async with group_world("memory", 1) as groups:
        layer = ColumnParallelLinear(D_IN, D_OUT, groups[0], rng=np.random.default_rng(0))
        with pytest.raises(InvalidState, match="off the event loop"):
            layer.forward(X)


def _qkv_rows(dim: int, span: tuple[int, int]) -> np.ndarray:
    a, b = span
    return np.concatenate([np.arange(k * dim + a, k * dim + b) for k in range(3)])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
async def test_a_parallel_block_equals_block(kind: str, size: int) -> None:
    dim, heads = 8, 4  # three ranks hold 2, 1 and 1 heads
    x = np.random.default_rng(7).standard_normal((2, 5, dim))
    dy = np.random.default_rng(8).standard_normal((2, 5, dim))
    ref = Block(dim, heads, rng=np.random.default_rng(9), dropout=0.1, seed=3)
    y_ref = ref.forward(x)
    dx_ref = ref.backward(dy)
    async with group_world(kind, size) as groups:
        blocks = [
            ParallelBlock(dim, heads, g, rng=np.random.default_rng(9), dropout=0.1, seed=3)
            for g in groups
        ]
        ys = await _on_threads(blocks, lambda blk: blk.forward(x))
        dxs = await _on_threads(blocks, lambda blk: blk.backward(dy))
    want = dict(ref.named_grads())
    for blk, y, dx in zip(blocks, ys, dxs, strict=True):
        np.testing.assert_allclose(y, y_ref, rtol=1e-10)
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
        got = dict(blk.named_grads())
        assert got.keys() == want.keys()
        rows = _qkv_rows(dim, blk.attn.qkv.span)
        a, b = blk.attn.proj.span
        c, d = blk.mlp[0].span
        expected = {
            "attn.qkv.weight": want["attn.qkv.weight"][rows],
            "attn.qkv.bias": want["attn.qkv.bias"][rows],
            "attn.proj.weight": want["attn.proj.weight"][:, a:b],
            "mlp.0.weight": want["mlp.0.weight"][c:d],
            "mlp.0.bias": want["mlp.0.bias"][c:d],
            "mlp.2.weight": want["mlp.2.weight"][:, c:d],
        }
        for name, value in got.items():
            np.testing.assert_allclose(
                value, expected.get(name, want[name]), rtol=1e-10, atol=1e-12, err_msg=name
            )
