"""Basic layers, each backward right below its forward."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
from numpy.typing import DTypeLike

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.nn.module import Module


class LinearLike(Protocol):
    """A layer computing ``x W^T + b`` with its parameters: :class:`Linear` and the
    tensor-parallel linears."""

    params: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    saved_input: np.ndarray | None


class Linear(Module):
    """y = x W^T + b, over the last axis. W: (out, in), initialised U(-1/sqrt(in), ..)."""

    ACTIVATIONS = ("saved_input",)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        rng: np.random.Generator,
        bias: bool = True,
        dtype: DTypeLike = np.float64,
    ) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)
        self.add_param("weight", rng.uniform(-bound, bound, (d_out, d_in)).astype(dtype))
        if bias:
            self.add_param("bias", np.zeros(d_out, dtype))
        self.saved_input: np.ndarray | None = None  # what backward needs of forward

    def forward(self, x: np.ndarray) -> np.ndarray:
        return apply_linear(self, x)

    def backward(self, dy: np.ndarray) -> np.ndarray:
        add_linear_grads(self, dy)
        return product(dy, self.params["weight"])


def rows(x: np.ndarray) -> np.ndarray:
    """``x`` as one matrix of rows (its last axis the columns)."""
    return x.reshape(-1, x.shape[-1])


def product(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``x @ m`` over the last axis of ``x``, as one matrix product of its rows: numpy
    multiplies a 3-d array by a matrix one batch entry at a time, in smaller products."""
    y = rows(x) @ m
    return y.reshape(*x.shape[:-1], y.shape[-1])


def apply_linear(module: LinearLike, x: np.ndarray) -> np.ndarray:
    """``x W^T + b`` with ``module``'s parameters, keeping ``x`` for backward."""
    module.saved_input = x
    y = product(x, module.params["weight"].T)
    if "bias" in module.params:
        y += module.params["bias"]  # y is new: in place saves an array of the output's size
    return y


def add_linear_grads(module: LinearLike, dy: np.ndarray) -> None:
    """Add dW = dy^T x (and db = sum dy) of ``y = x W^T + b`` to ``module.grads``, with
    ``x`` the input its forward kept in ``module.saved_input``."""
    x = module.saved_input
    assert x is not None, "backward before forward"
    flat_dy = rows(dy)
    module.grads["weight"] += flat_dy.T @ rows(x)
    if "bias" in module.grads:
        module.grads["bias"] += flat_dy.sum(axis=0)


class Embedding(Module):
    """Rows of a (vocab, dim) table, N(0, 0.02) initialised."""

    ACTIVATIONS = ("_ids",)

    def __init__(
        self, vocab: int, dim: int, *, rng: np.random.Generator, dtype: DTypeLike = np.float64
    ) -> None:
        super().__init__()
        self.add_param("weight", (rng.standard_normal((vocab, dim)) * 0.02).astype(dtype))
        self._ids: np.ndarray | None = None

    def forward(self, ids: np.ndarray) -> np.ndarray:
        self._ids = ids
        return self.params["weight"][ids]

    def backward(self, dy: np.ndarray) -> np.ndarray:
        assert self._ids is not None, "backward before forward"
        np.add.at(self.grads["weight"], self._ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
        return np.zeros(self._ids.shape)  # ids have no gradient


class LayerNorm(Module):
    """Normalise the last axis, then scale and shift."""

    ACTIVATIONS = ("_cache",)

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype: DTypeLike = np.float64):
        super().__init__()
        self.eps = eps
        self.add_param("weight", np.ones(dim, dtype))
        self.add_param("bias", np.zeros(dim, dtype))
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        inv_std = 1.0 / np.sqrt(x.var(axis=-1, keepdims=True) + self.eps)
        x_hat = (x - mean) * inv_std
        self._cache = (x_hat, inv_std)
        return x_hat * self.params["weight"] + self.params["bias"]

    def backward(self, dy: np.ndarray) -> np.ndarray:
        assert self._cache is not None, "backward before forward"
        x_hat, inv_std = self._cache
        axes = tuple(range(dy.ndim - 1))
        self.grads["weight"] += (dy * x_hat).sum(axis=axes)
        self.grads["bias"] += dy.sum(axis=axes)
        g = dy * self.params["weight"]
        return inv_std * (
            g - g.mean(axis=-1, keepdims=True) - x_hat * (g * x_hat).mean(axis=-1, keepdims=True)
        )


class ReLU(Module):
    ACTIVATIONS = ("_mask",)

    def __init__(self) -> None:
        super().__init__()
        self._mask: np.ndarray | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._mask = x > 0
        return x * self._mask

    def backward(self, dy: np.ndarray) -> np.ndarray:
        assert self._mask is not None, "backward before forward"
        return dy * self._mask


_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Module):
    """GELU, tanh approximation (Hendrycks & Gimpel, 2016)."""

    ACTIVATIONS = ("_cache",)

    def __init__(self) -> None:
        super().__init__()
        self._cache: tuple[np.ndarray, np.ndarray] | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        # tanh(c (x + 0.044715 x^3)), with x^3 as products: numpy's float32 ``x**3`` took
        # 63 ms for 1 Mi elements here against 0.2 ms (38 % of a charlm step)
        u = x * x
        u *= 0.044715
        u += 1.0
        u *= x
        u *= _GELU_C
        t = np.tanh(u, out=u)
        self._cache = (x, t)
        y = t + 1.0
        y *= x
        y *= 0.5
        return y

    def backward(self, dy: np.ndarray) -> np.ndarray:
        assert self._cache is not None, "backward before forward"
        x, t = self._cache
        # dy * (0.5 (1 + t) + 0.5 x dt), dt = (1 - t^2) c (1 + 3 * 0.044715 x^2), in
        # place in two buffers (the expression made ten temporaries: 11 % of a step)
        g = x * x
        g *= 3 * 0.044715 * _GELU_C
        g += _GELU_C
        s = t * t
        np.subtract(1.0, s, out=s)
        g *= s
        g *= x
        np.add(g, t, out=g)
        g += 1.0
        g *= 0.5
        g *= dy
        return g


class Dropout(Module):
    """Inverted dropout with its own seeded generator (identical streams on every rank
    that seeds it alike); the identity in eval mode."""

    ACTIVATIONS = ("_mask",)

    def __init__(self, p: float, *, seed: int) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise InvalidArgument(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self._rng = np.random.default_rng(seed)
        self._mask: np.ndarray | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        if not self.training or self.p == 0.0:
            self._mask = None
            return x
        mask = (self._rng.random(x.shape) >= self.p).astype(x.dtype)  # not float64
        mask /= 1.0 - self.p
        self._mask = mask
        return x * self._mask

    def backward(self, dy: np.ndarray) -> np.ndarray:
        return dy if self._mask is None else dy * self._mask
