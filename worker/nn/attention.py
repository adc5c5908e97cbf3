"""Causal multi-head self-attention, forward and backward.

att = softmax(mask(q k^T / sqrt(d_head))); out = proj(att v). The backward of softmax
along the last axis is p * (g - sum(g * p)); masked positions have p = 0 and get no
gradient.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.nn.layers import Linear
from shardwire.worker.nn.module import Module


class CausalSelfAttention(Module):
    """Input and output (batch, time, dim); ``heads`` must divide ``dim``."""

    ACTIVATIONS = ("_cache",)

    def __init__(
        self, dim: int, heads: int, *, rng: np.random.Generator, dtype: DTypeLike = np.float64
    ) -> None:
        super().__init__()
        if dim % heads:
            raise InvalidArgument(f"dim {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = self.add("qkv", Linear(dim, 3 * dim, rng=rng, dtype=dtype))
        self.proj = self.add("proj", Linear(dim, dim, rng=rng, dtype=dtype))
        self._cache: tuple[np.ndarray, ...] | None = None

    def _split(self, x: np.ndarray) -> np.ndarray:
        b, t, d = x.shape
        return x.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3)

    @staticmethod
    def _merge(x: np.ndarray) -> np.ndarray:
        b, h, t, hd = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, t, h * hd)

    def forward(self, x: np.ndarray) -> np.ndarray:
        t = x.shape[1]
        q, k, v = (self._split(part) for part in np.split(self.qkv(x), 3, axis=-1))
        scale = 1.0 / math.sqrt(q.shape[-1])  # 1 / sqrt(d_head)
        scores = (q @ k.transpose(0, 1, 3, 2)) * scale
        future = np.triu(np.ones((t, t), dtype=bool), k=1)
        scores = np.where(future, -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        # kept in the activations' dtype: a float64 0-d array would make the whole
        # backward float64 (numpy promotes to it), at twice the cost of every product
        self._cache = (q, k, v, p, np.asarray(scale, dtype=q.dtype))
        return self.proj(self._merge(p @ v))

    def backward(self, dy: np.ndarray) -> np.ndarray:
        assert self._cache is not None, "backward before forward"
        q, k, v, p, scale = self._cache
        d_out = self._split(self.proj.backward(dy))
        dv = p.transpose(0, 1, 3, 2) @ d_out
        dp = d_out @ v.transpose(0, 1, 3, 2)
        d_scores = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
        dq = d_scores @ k
        dk = d_scores.transpose(0, 1, 3, 2) @ q
        d_qkv = np.concatenate([self._merge(dq), self._merge(dk), self._merge(dv)], axis=-1)
        return self.qkv.backward(d_qkv)
