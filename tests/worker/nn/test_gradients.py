"""Every layer's backward against central finite differences (float64)."""

from __future__ import annotations

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument
from shardwire.worker.nn import (
    GELU,
    Block,
    CausalSelfAttention,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    ReLU,
    Sequential,
    TransformerLM,
    mse,
    softmax_cross_entropy,
)

EPS = 1e-6


def numeric_grad(f, x: np.ndarray) -> np.ndarray:
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + EPS
        up = f()
        flat[i] = old - EPS
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * EPS)
    return grad


def check_module(module, x: np.ndarray, *, wrt_input: bool = True) -> None:
    rng = np.random.default_rng(1)
    y = module.forward(x)
    weights = rng.standard_normal(y.shape)  # loss = sum(weights * y)
    module.zero_grad()
    dx = module.backward(weights)

    def loss() -> float:
        return float((module.forward(x) * weights).sum())

    for name, param in module.named_parameters():
        analytic = dict(module.named_grads())[name]
        np.testing.assert_allclose(
            analytic, numeric_grad(loss, param), rtol=1e-5, atol=1e-7, err_msg=name
        )
    if wrt_input:
        np.testing.assert_allclose(dx, numeric_grad(loss, x), rtol=1e-5, atol=1e-7)


def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Linear(5, 3, rng=rng()),
        lambda: Linear(5, 3, rng=rng(), bias=False),
        lambda: LayerNorm(6),
        ReLU,
        GELU,
        lambda: Sequential(Linear(4, 6, rng=rng()), GELU(), Linear(6, 2, rng=rng())),
    ],
)
def test_layer_gradients(make) -> None:
    module = make()
    if isinstance(module, Linear):
        d_in = 5
    elif isinstance(module, Sequential):
        d_in = 4
    else:
        d_in = 6
    x = rng().standard_normal((2, 3, d_in)) + 0.1  # keep ReLU away from its kink
    check_module(module, x)


def test_layernorm_gradient_with_nontrivial_affine() -> None:
    ln = LayerNorm(5)
    ln.params["weight"][:] = rng().standard_normal(5)
    ln.params["bias"][:] = rng().standard_normal(5)
    check_module(ln, rng().standard_normal((4, 5)))


def test_attention_gradients() -> None:
    check_module(CausalSelfAttention(8, 2, rng=rng()), rng().standard_normal((2, 5, 8)))


def test_attention_is_causal() -> None:
    attn = CausalSelfAttention(8, 2, rng=rng())
    x = rng().standard_normal((1, 6, 8))
    y = attn(x)
    x2 = x.copy()
    x2[0, 4:] += 10.0  # changing the future must not change the past
    np.testing.assert_allclose(attn(x2)[0, :4], y[0, :4], rtol=1e-12)


def test_block_gradients() -> None:
    check_module(Block(8, 2, rng=rng()), rng().standard_normal((2, 4, 8)))


def test_dropout_gradient_uses_the_same_mask() -> None:
    drop = Dropout(0.5, seed=3)
    x = rng().standard_normal((4, 6))
    y = drop(x)
    dx = drop.backward(np.ones_like(x))
    np.testing.assert_array_equal(dx, (y != 0) * 2.0)
    assert drop.eval()(x) is x


def test_embedding_gradient_accumulates_repeated_ids() -> None:
    emb = Embedding(5, 3, rng=rng())
    ids = np.array([[1, 1, 4]])
    emb(ids)
    emb.backward(np.ones((1, 3, 3)))
    np.testing.assert_array_equal(emb.grads["weight"][1], [2, 2, 2])
    np.testing.assert_array_equal(emb.grads["weight"][4], [1, 1, 1])
    assert emb.grads["weight"][0].sum() == 0


def test_language_model_gradients_end_to_end() -> None:
    model = TransformerLM(vocab=7, dim=8, heads=2, layers=2, context=6, rng=rng())
    ids = rng().integers(0, 7, (2, 5))
    targets = rng().integers(0, 7, (2, 5))

    def loss() -> float:
        return softmax_cross_entropy(model(ids), targets)[0]

    model.zero_grad()
    _, dlogits = softmax_cross_entropy(model(ids), targets)
    model.backward(dlogits)
    grads = dict(model.named_grads())
    for name, param in model.named_parameters():
        np.testing.assert_allclose(
            grads[name], numeric_grad(loss, param), rtol=1e-4, atol=1e-8, err_msg=name
        )


def test_parameter_names_are_dotted_paths() -> None:
    model = TransformerLM(vocab=7, dim=8, heads=2, layers=2, context=6, rng=rng())
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.1.attn.qkv.weight" in names and "blocks.0.mlp.2.bias" in names
    assert names[0] == "tok.weight" and names[-1] == "head.weight"


def test_same_seed_same_initialisation() -> None:
    a = TransformerLM(vocab=7, dim=8, heads=2, layers=2, context=6, rng=np.random.default_rng(5))
    b = TransformerLM(vocab=7, dim=8, heads=2, layers=2, context=6, rng=np.random.default_rng(5))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb
        np.testing.assert_array_equal(pa, pb)


@pytest.mark.parametrize("loss_fn", ["xent", "mse"])
def test_loss_gradients(loss_fn: str) -> None:
    pred = rng().standard_normal((4, 5))
    if loss_fn == "xent":
        targets = np.array([0, 3, 1, 4])
        fn = lambda: softmax_cross_entropy(pred, targets, denom=7)  # noqa: E731
    else:
        targets = rng().standard_normal((4, 5))
        fn = lambda: mse(pred, targets, denom=7)  # noqa: E731
    _, analytic = fn()
    np.testing.assert_allclose(analytic, numeric_grad(lambda: fn()[0], pred), rtol=1e-6)


def test_cross_entropy_value() -> None:
    logits = np.log(np.array([[0.25, 0.75]]))
    loss, _ = softmax_cross_entropy(logits, np.array([1]))
    assert loss == pytest.approx(-np.log(0.75))


def test_ignored_targets_count_for_nothing_and_match_finite_differences() -> None:
    pred = rng().standard_normal((5, 4))
    targets = np.array([0, -100, 3, -100, 1])
    loss, analytic = softmax_cross_entropy(pred, targets)
    kept, _ = softmax_cross_entropy(pred[[0, 2, 4]], targets[[0, 2, 4]])
    assert loss == pytest.approx(kept)  # mean over the three kept rows only
    assert not analytic[[1, 3]].any()
    numeric = numeric_grad(lambda: softmax_cross_entropy(pred, targets)[0], pred)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-10)
    custom, _ = softmax_cross_entropy(pred, np.array([0, 7, 3, 7, 1]), ignore_index=7)
    assert custom == pytest.approx(loss)
    nothing, grad = softmax_cross_entropy(pred, np.full(5, -100))
    assert nothing == 0.0 and not grad.any()


@pytest.mark.parametrize("target", [-1, 4, 99])
def test_out_of_range_targets_are_refused(target: int) -> None:
    with pytest.raises(InvalidArgument, match=f"target {target} is outside \\[0, 4\\)"):
        softmax_cross_entropy(np.zeros((2, 4)), np.array([0, target]))
    with pytest.raises(InvalidArgument, match="outside"):  # -100 is a target like any other
        softmax_cross_entropy(np.zeros((2, 4)), np.array([0, -100]), ignore_index=None)


def test_mse_divides_by_rows_not_elements() -> None:
    loss, _ = mse(np.ones((2, 3)), np.zeros((2, 3)))
    assert loss == 3.0  # six unit errors over two rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_is_the_tanh_approximation_in_the_input_dtype(dtype) -> None:
    x = np.random.default_rng(5).standard_normal((3, 7, 16)).astype(dtype) * 3
    y = GELU()(x)
    wide = x.astype(np.float64)
    want = 0.5 * wide * (1 + np.tanh(np.sqrt(2 / np.pi) * (wide + 0.044715 * wide**3)))
    assert y.dtype == dtype
    tol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, want, rtol=tol, atol=tol)


def test_a_float32_model_computes_its_backward_in_float32() -> None:
    """No layer widens the activations or the gradient (dropout on): float64 costs twice
    the time of every product in every layer below it."""
    model = TransformerLM(
        vocab=11,
        dim=8,
        heads=2,
        layers=2,
        context=6,
        rng=np.random.default_rng(0),
        dtype=np.float32,
        dropout=0.1,
    )
    widths: list[tuple[str, np.dtype]] = []
    for name, module in [
        ("head", model.head),
        ("block", model.blocks),
        ("attn", model.blocks[0].attn),
    ]:
        backward = module.backward

        def spy(dy, _backward=backward, _name=name):
            dx = _backward(dy)
            widths.append((_name, dx.dtype))
            return dx

        module.backward = spy
    ids = np.random.default_rng(1).integers(0, 11, (3, 6))
    logits = model(ids)
    _, dlogits = softmax_cross_entropy(logits, ids)
    model.backward(dlogits)
    assert sorted(widths) == [("attn", np.float32), ("block", np.float32), ("head", np.float32)]
    assert all(g.dtype == np.float32 for _, g in model.named_grads())


@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8)])
def test_gelu_backward_matches_its_closed_form(shape) -> None:
    x = np.random.default_rng(6).standard_normal(shape) * 2
    dy = np.random.default_rng(7).standard_normal(shape)
    gelu = GELU()
    gelu(x)
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    want = dy * (0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2))
    np.testing.assert_allclose(gelu.backward(dy), want, rtol=1e-12, atol=1e-12)
