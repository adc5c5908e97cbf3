"""A pre-norm transformer block and a small character-level language model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import DTypeLike

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.nn.attention import CausalSelfAttention
from shardwire.worker.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear
from shardwire.worker.nn.module import Module, Sequential


class Block(Module):
    """x + attn(ln1(x)), then h + mlp(ln2(h)) with a 4x GELU MLP."""

    def __init__(
        self,
        dim: int,
        heads: int,
        *,
        rng: np.random.Generator,
        dropout: float = 0.0,
        seed: int = 0,
        dtype: DTypeLike = np.float64,
    ) -> None:
        super().__init__()
        self.ln1 = self.add("ln1", LayerNorm(dim, dtype=dtype))
        self.attn = self.add("attn", CausalSelfAttention(dim, heads, rng=rng, dtype=dtype))
        self.ln2 = self.add("ln2", LayerNorm(dim, dtype=dtype))
        self.mlp = self.add(
            "mlp",
            Sequential(
                Linear(dim, 4 * dim, rng=rng, dtype=dtype),
                GELU(),
                Linear(4 * dim, dim, rng=rng, dtype=dtype),
                Dropout(dropout, seed=seed),
            ),
        )

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))

    def backward(self, dy: np.ndarray) -> np.ndarray:
        dh = dy + self.ln2.backward(self.mlp.backward(dy))
        return dh + self.ln1.backward(self.attn.backward(dh))


class TransformerLM(Module):
    """Token + position embeddings, ``layers`` blocks, final norm, vocabulary head.

    ``block`` builds each block (default :class:`Block`; e.g.
    ``functools.partial(ParallelBlock, group=tp)`` for tensor parallelism) and is called
    with the same arguments and random draws, so the models agree value for value."""

    def __init__(
        self,
        *,
        vocab: int,
        dim: int,
        heads: int,
        layers: int,
        context: int,
        rng: np.random.Generator,
        dropout: float = 0.0,
        seed: int = 0,
        dtype: DTypeLike = np.float64,
        block: Callable[..., Module] = Block,
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = self.add("tok", Embedding(vocab, dim, rng=rng, dtype=dtype))
        self.pos = self.add("pos", Embedding(context, dim, rng=rng, dtype=dtype))
        self.blocks = self.add(
            "blocks",
            Sequential(
                *(
                    block(dim, heads, rng=rng, dropout=dropout, seed=seed + i, dtype=dtype)
                    for i in range(layers)
                )
            ),
        )
        self.ln_f = self.add("ln_f", LayerNorm(dim, dtype=dtype))
        self.head = self.add("head", Linear(dim, vocab, rng=rng, bias=False, dtype=dtype))

    def pipeline_layers(self) -> list[Module]:
        """The model as a list of layers for a pipeline (embeddings, each block, final
        norm with the head), sharing this model's modules and parameters: applied in
        order they compute :meth:`forward`, and backward in reverse computes backward."""
        return [_Embed(self), *self.blocks.children.values(), _Head(self)]

    def pipeline_stage(self, layers: range) -> Module:
        """Layers ``layers`` of :meth:`pipeline_layers` as one module (a pipeline stage)
        whose parameters carry the whole model's names (``tok.weight``,
        ``blocks.3.attn.qkv.weight``, ``head.weight``): its state dict and checkpoint
        pieces read the same whatever the pipeline's split, and as the whole model's."""
        return _Stage(self, layers)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        t = ids.shape[-1]
        if t > self.context:
            raise InvalidArgument(f"sequence of {t} exceeds the context of {self.context}")
        x = self.tok(ids) + self.pos(np.arange(t))
        return self.head(self.ln_f(self.blocks(x)))

    def backward(self, dlogits: np.ndarray) -> np.ndarray:
        dx = self.blocks.backward(self.ln_f.backward(self.head.backward(dlogits)))
        self.pos.backward(dx.sum(axis=0))
        return self.tok.backward(dx)


class _Embed(Module):
    """Token plus position embeddings of a TransformerLM (its first pipeline layer)."""

    def __init__(self, lm: TransformerLM) -> None:
        super().__init__()
        self.context = lm.context
        self.tok = self.add("tok", lm.tok)
        self.pos = self.add("pos", lm.pos)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        t = ids.shape[-1]
        if t > self.context:
            raise InvalidArgument(f"sequence of {t} exceeds the context of {self.context}")
        return self.tok(ids) + self.pos(np.arange(t))

    def backward(self, dx: np.ndarray) -> np.ndarray:
        self.pos.backward(dx.sum(axis=0))
        return self.tok.backward(dx)


class _Head(Module):
    """Final norm and vocabulary head of a TransformerLM (its last pipeline layer)."""

    def __init__(self, lm: TransformerLM) -> None:
        super().__init__()
        self.ln_f = self.add("ln_f", lm.ln_f)
        self.head = self.add("head", lm.head)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return self.head(self.ln_f(x))

    def backward(self, dlogits: np.ndarray) -> np.ndarray:
        return self.ln_f.backward(self.head.backward(dlogits))


class _Stage(Module):
    """Consecutive pipeline layers of a TransformerLM, named as in the model."""

    def __init__(self, lm: TransformerLM, part: range) -> None:
        super().__init__()
        every = lm.pipeline_layers()
        if not part or part.start < 0 or part.stop > len(every) or part.step != 1:
            raise InvalidArgument(f"layers {part} are not consecutive layers of {len(every)}")
        self._layers = [every[i] for i in part]  # applied in order (not children: names)
        blocks: Module | None = None
        for i in part:
            if i == 0:
                self.add("tok", lm.tok)
                self.add("pos", lm.pos)
            elif i == len(every) - 1:
                self.add("ln_f", lm.ln_f)
                self.add("head", lm.head)
            else:
                blocks = blocks or self.add("blocks", Module())
                blocks.add(str(i - 1), every[i])

    def forward(self, x: np.ndarray) -> np.ndarray:
        for layer in self._layers:
            x = layer.forward(x)
        return x

    def backward(self, dy: np.ndarray) -> np.ndarray:
        for layer in reversed(self._layers):
            dy = layer.backward(dy)
        return dy
