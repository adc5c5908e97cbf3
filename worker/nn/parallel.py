"""Tensor-parallel linear layers (Megatron-style) over a collective group.

``ColumnParallelLinear`` splits a linear layer's output features over the group: rank r
holds rows ``a_r..b_r`` of the weight (and of the bias) and computes those outputs.
``RowParallelLinear`` splits the input features: rank r holds columns ``a_r..b_r``,
computes a partial product, and the partial products are summed. Uneven splits are
fine (the first ranks take one more feature). Forward and backward use the conjugate
collectives:

==========================  ==================  ==================
layer                        forward             backward
==========================  ==================  ==================
column, input                identity            all_reduce(dx)
column, ``gather_output``    all_gather(y)       slice dy
row, ``input_is_parallel``   all_reduce(y)       identity
row, full input              slice x             all_gather(dx)
==========================  ==================  ==================

so column -> row (an MLP, or attention's heads then its output projection) needs one
all-reduce forward and one backward. Both layers draw their full weight from ``rng``
exactly as :class:`~shardwire.worker.nn.layers.Linear` does and keep their part, so a
parallel model equals the single-process one parameter for parameter.

The layers are ordinary modules: numpy forward and backward, called off the event loop
(FSDP's compute thread, or ``asyncio.to_thread``). Their collectives run on the loop the
layer was built on, one at a time, in program order, on the layer's own group.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.collectives import Group
from shardwire.worker.collectives.threads import LoopBridge
from shardwire.worker.kernels.segments import bounds
from shardwire.worker.nn.attention import CausalSelfAttention
from shardwire.worker.nn.layers import (
    GELU,
    Dropout,
    LayerNorm,
    add_linear_grads,
    apply_linear,
    product,
)
from shardwire.worker.nn.module import Module, Sequential
from shardwire.worker.nn.transformer import Block
from shardwire.worker.parallelism import Mesh


class _Bridge:
    """A layer's group, whose collectives its compute thread runs on the group's loop."""

    def __init__(self, group: Group):
        self.group = group
        self._loop = LoopBridge(asyncio.get_running_loop(), timeout=group.timeout)

    def run(self, call: Callable[[], Awaitable[np.ndarray]]) -> np.ndarray:
        async def go() -> np.ndarray:
            return await call()  # the call (and its sequence number) is made on the loop

        return self._loop.wait(go())


def _lastaxis_gather(bridge: _Bridge, part: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Concatenate every rank's ``part`` along the last axis (rank order)."""
    moved = np.ascontiguousarray(np.moveaxis(part, -1, 0))
    full = bridge.run(lambda: bridge.group.all_gather(moved, sizes=sizes))
    return np.moveaxis(full, 0, -1)


def _weight(d_in: int, d_out: int, rng: np.random.Generator, dtype: DTypeLike) -> np.ndarray:
    bound = 1.0 / math.sqrt(d_in)  # as Linear draws it
    return rng.uniform(-bound, bound, (d_out, d_in)).astype(dtype)


def _spans(features: int, unit: int, size: int) -> list[tuple[int, int]]:
    """Each rank's features, split in whole units of ``unit`` features (e.g. heads)."""
    if features % unit:
        raise InvalidArgument(f"{features} features are not whole units of {unit}")
    if features // unit < size:
        raise InvalidArgument(f"{features // unit} units cannot be split over {size} ranks")
    return [(a * unit, b * unit) for a, b in bounds(features // unit, size)]


@dataclass(frozen=True)
class Partition:
    """How a parameter is split over a tensor-parallel group of ``of`` ranks: along
    ``axis`` (of ``length`` features in the whole parameter), in whole units of ``unit``
    features, each of ``blocks`` equal blocks split alike (see the layers)."""

    axis: int
    length: int
    of: int
    unit: int = 1
    blocks: int = 1

    def indices(self, rank: int) -> np.ndarray:
        """The features along ``axis`` that ``rank`` holds, in the order it holds them."""
        per = self.length // self.blocks
        a, b = _spans(per, self.unit, self.of)[rank]
        return np.concatenate([np.arange(k * per + a, k * per + b) for k in range(self.blocks)])

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The whole parameter's shape, from a slice's shape."""
        return tuple(self.length if i == self.axis else n for i, n in enumerate(local))

    def describe(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("axis", "length", "of", "unit", "blocks")}


class ColumnParallelLinear(Module):
    """y = x W^T + b with the output features split over ``group`` (see the module).

    ``group`` is the tensor-parallel group, or a :class:`~shardwire.worker.parallelism.Mesh`
    (its ``tp``); the same for the other layers here.

    ``gather_output``: return every output feature (all-gather) instead of this rank's.
    ``unit``: split in whole groups of this many features (an attention head's width).
    ``blocks``: the outputs are this many equal blocks (attention's q, k and v), each
    split over the ranks alike; this rank's rows are its part of every block, in order.
    """

    ACTIVATIONS = ("saved_input",)
    PARTITIONED = ("weight", "bias")  # parameters split over the group (each rank a slice)

    def __init__(
        self,
        d_in: int,
        d_out: int,
        group: Group | Mesh,
        *,
        rng: np.random.Generator,
        bias: bool = True,
        gather_output: bool = True,
        unit: int = 1,
        blocks: int = 1,
        dtype: DTypeLike = np.float64,
    ) -> None:
        super().__init__()
        group = tensor_group(group)
        if blocks > 1 and gather_output:
            raise InvalidArgument(
                "gather_output needs blocks=1 (the gathered rows would interleave)"
            )
        self._bridge = _Bridge(group)
        self.gather_output = gather_output
        spans = _spans(d_out // blocks, unit, group.size)
        self.splits = [b - a for a, b in spans]
        self.span = spans[group.rank]
        self.partition = Partition(0, d_out, group.size, unit, blocks)  # weight and bias
        rows = self.partition.indices(group.rank)
        self.add_param("weight", _weight(d_in, d_out, rng, dtype)[rows])
        if bias:
            self.add_param("bias", np.zeros(rows.size, dtype))
        self.saved_input: np.ndarray | None = None

    @property
    def group(self) -> Group:
        """The tensor-parallel group this layer is split over."""
        return self._bridge.group

    def forward(self, x: np.ndarray) -> np.ndarray:
        y = apply_linear(self, x)
        return _lastaxis_gather(self._bridge, y, self.splits) if self.gather_output else y

    def backward(self, dy: np.ndarray) -> np.ndarray:
        if self.gather_output:
            a, b = self.span
            dy = dy[..., a:b]
        add_linear_grads(self, dy)
        partial = np.ascontiguousarray(product(dy, self.params["weight"]))
        group = self._bridge.group
        return self._bridge.run(lambda: group.all_reduce(partial))


class RowParallelLinear(Module):
    """y = x W^T + b with the input features split over ``group`` (see the module).

    ``input_is_parallel``: ``x`` is already this rank's slice of the features (the output
    of a ColumnParallelLinear without gather); otherwise the layer takes its slice of the
    full ``x`` and backward returns the full ``dx``. The bias is added once, after the sum.
    ``unit``: split in whole groups of this many features (an attention head's width).
    """

    ACTIVATIONS = ("saved_input",)
    PARTITIONED = ("weight",)  # the bias is added once, after the sum: every rank holds it

    def __init__(
        self,
        d_in: int,
        d_out: int,
        group: Group | Mesh,
        *,
        rng: np.random.Generator,
        bias: bool = True,
        input_is_parallel: bool = True,
        unit: int = 1,
        dtype: DTypeLike = np.float64,
    ) -> None:
        super().__init__()
        group = tensor_group(group)
        self._bridge = _Bridge(group)
        self.input_is_parallel = input_is_parallel
        spans = _spans(d_in, unit, group.size)
        self.splits = [b - a for a, b in spans]
        self.span = spans[group.rank]
        self.partition = Partition(1, d_in, group.size, unit)  # the weight's columns
        a, b = self.span
        full = _weight(d_in, d_out, rng, dtype)
        self.add_param("weight", np.ascontiguousarray(full[:, a:b]))
        if bias:
            self.add_param("bias", np.zeros(d_out, dtype))
        self.saved_input: np.ndarray | None = None

    @property
    def group(self) -> Group:
        """The tensor-parallel group this layer is split over."""
        return self._bridge.group

    def forward(self, x: np.ndarray) -> np.ndarray:
        if not self.input_is_parallel:
            a, b = self.span
            x = x[..., a:b]
        self.saved_input = x
        partial = np.ascontiguousarray(product(x, self.params["weight"].T))
        group = self._bridge.group
        y = self._bridge.run(lambda: group.all_reduce(partial))
        if "bias" in self.params:
            y = y + self.params["bias"]
        return y

    def backward(self, dy: np.ndarray) -> np.ndarray:
        add_linear_grads(self, dy)
        dx = product(dy, self.params["weight"])
        if self.input_is_parallel:
            return dx
        return _lastaxis_gather(self._bridge, dx, self.splits)


class ParallelAttention(CausalSelfAttention):
    """Causal self-attention with its heads split over ``group``: q, k, v of this rank's
    heads (a column-parallel projection), attention per head, and the output projection
    row-parallel, so the only collective is one all-reduce each way."""

    def __init__(
        self,
        dim: int,
        heads: int,
        group: Group | Mesh,
        *,
        rng: np.random.Generator,
        dtype: DTypeLike = np.float64,
    ) -> None:
        Module.__init__(self)
        group = tensor_group(group)
        if dim % heads:
            raise InvalidArgument(f"dim {dim} is not divisible by {heads} heads")
        width = dim // heads
        a, b = _spans(dim, width, group.size)[group.rank]
        self.heads = (b - a) // width  # this rank's heads
        self.qkv = self.add(
            "qkv",
            ColumnParallelLinear(
                dim,
                3 * dim,
                group,
                rng=rng,
                gather_output=False,
                unit=width,
                blocks=3,
                dtype=dtype,
            ),
        )
        self.proj = self.add(
            "proj",
            RowParallelLinear(dim, dim, group, rng=rng, unit=width, dtype=dtype),
        )
        self._cache = None


class ParallelBlock(Block):
    """:class:`Block` with attention heads and the MLP split over ``group`` (MLP column
    then row); the layer norms are replicated. Equal to Block built from the same rng."""

    def __init__(
        self,
        dim: int,
        heads: int,
        group: Group | Mesh,
        *,
        rng: np.random.Generator,
        dropout: float = 0.0,
        seed: int = 0,
        dtype: DTypeLike = np.float64,
    ) -> None:
        Module.__init__(self)
        self.ln1 = self.add("ln1", LayerNorm(dim, dtype=dtype))
        self.attn = self.add("attn", ParallelAttention(dim, heads, group, rng=rng, dtype=dtype))
        self.ln2 = self.add("ln2", LayerNorm(dim, dtype=dtype))
        self.mlp = self.add(
            "mlp",
            Sequential(
                ColumnParallelLinear(
                    dim, 4 * dim, group, rng=rng, gather_output=False, dtype=dtype
                ),
                GELU(),
                RowParallelLinear(4 * dim, dim, group, rng=rng, dtype=dtype),
                Dropout(dropout, seed=seed),  # the same mask on every rank of the group
            ),
        )


def tensor_group(group: Group | Mesh) -> Group:
    """The tensor-parallel group of ``group`` (a mesh's ``tp``, or the group itself)."""
    return group.tp if isinstance(group, Mesh) else group


def partitioned(model: Module) -> tuple[frozenset[str], Group | None]:
    """The dotted names of ``model``'s parameters split over a tensor-parallel group (each
    rank holds a slice; the others every rank of that group holds alike), and that
    group (None if no layer is split). One model has one tensor-parallel group."""
    parts, group = partitions(model)
    return frozenset(parts), group


def partitions(model: Module) -> tuple[dict[str, Partition], Group | None]:
    """How each of ``model``'s split parameters is split, by dotted name, and the
    tensor-parallel group they are split over (None if no layer is split)."""
    found: dict[str, Partition] = {}
    group: Group | None = None
    for path, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        keys, mine = module.PARTITIONED, module.group
        if group is not None and mine is not group:
            raise InvalidArgument(
                f"{path} is split over another tensor-parallel group than the rest"
            )
        group = mine
        for k in keys:
            if k in module.params:
                found[f"{path}.{k}" if path else k] = module.partition
    return found, group
