"""Pipeline parallelism: contiguous stages of a model on successive ranks, micro-batches
flowing through them, with the GPipe, 1F1B or interleaved 1F1B schedule.

Each rank of the pipeline's group runs one stage (a module: its contiguous share of the
layers, see :func:`split_into_stages`), or, with the interleaved schedule, ``chunks``
stages: the model is split into ``p * chunks`` stages and rank r holds stages r, r + p,
r + 2p, ... (its chunks, in that order). A step splits the batch into
``micro_batches``; stage g receives each micro-batch's activations from stage g - 1,
computes, and sends its output to stage g + 1; the last stage computes the loss and its
gradient, and gradients travel back the same way. Gradients accumulate in the stage's
modules over the micro-batches, as in single-process gradient accumulation.

Which pass runs when is the schedule's (``nn.schedules``: the orders, their bubbles and
a simulated timeline). Either way a stage keeps each in-flight micro-batch's activations
(``Module.stash``). The numpy work runs in a thread and a neighbour's sends land in this
rank's mailbox meanwhile, so communication overlaps compute.

A stage may be sharded over its data-parallel ranks: pass its FSDP object (made with
``FSDP.create(stage, mesh)``) instead of the module. Its forward and backward then
gather the parameters unit by unit, gradients accumulate unreduced over the
micro-batches (``no_sync``) and the last micro-batch's backward reduce-scatters their
sum; the optimizer steps on the shards (``await fsdp.step()``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.collectives import Group
from shardwire.worker.nn import schedules
from shardwire.worker.nn.module import Module
from shardwire.worker.nn.parallel import partitioned
from shardwire.worker.parallelism import Mesh, clip_scale, global_norm

Loss = Callable[[np.ndarray, np.ndarray], tuple[float, np.ndarray]]


def split_into_stages(weights: Sequence[float] | int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the heaviest stage's total
    weight (parameter count or measured time per layer; an int: that many layers of
    equal weight); every stage gets a layer."""
    if isinstance(weights, int):
        weights = [1.0] * weights
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise InvalidArgument(f"cannot split {n} layers into {num_stages} stages")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    # best[k][i]: the lightest possible heaviest stage for layers[:i] in k stages
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        bounds.append(range(int(cut[k][i]), i))
        i = int(cut[k][i])
    return bounds[::-1]


@dataclass(frozen=True)
class PipelineParallelConfig:
    """How many stages (ranks), micro-batches per step, the schedule ("gpipe", "1f1b" or
    "interleaved") and, for the interleaved one, the chunks (stages) each rank holds."""

    num_stages: int
    num_micro_batches: int
    schedule: str = "1f1b"
    chunks: int = 1

    def __post_init__(self) -> None:
        schedules.check(self.schedule, self.num_stages, self.num_micro_batches, self.chunks)
        if self.schedule == "interleaved" and self.num_stages < 2:
            raise InvalidArgument("the interleaved schedule needs at least 2 stages")


@runtime_checkable
class ShardedStage(Protocol):
    """A stage's module sharded over its data-parallel ranks (an FSDP object)."""

    model: Module
    mesh: Mesh | None

    async def forward(self, x: np.ndarray) -> np.ndarray: ...

    async def backward(self, dy: np.ndarray) -> np.ndarray: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    async def clip_grad_norm(self, max_norm: float) -> float: ...


class PipelineStage:
    """One rank's stage: ``await stage.step(inputs, targets)`` per training step.

    ``group`` holds the stages in order (group rank s runs stage s). The first stage gets
    ``inputs``, the last ``targets`` and ``loss`` (returning the loss and its gradient for
    one micro-batch; scale it for the whole batch, as for gradient accumulation).
    ``data_parallel``: the ranks running this same stage for other slices of the batch
    (pipeline x data parallel); each step ends by summing the stage's gradients over them.
    ``group`` may be a :class:`~shardwire.worker.parallelism.Mesh`: its ``pp`` holds the stages,
    its ``dp`` is ``data_parallel``, and clipping counts its tensor-parallel slices.
    ``module`` may be an FSDP object over ``group``'s mesh (one chunk): the stage is then
    sharded over the data-parallel ranks (see the module).
    """

    def __init__(
        self,
        module: Module | Sequence[Module],
        group: Group | Mesh,
        config: PipelineParallelConfig,
        *,
        loss: Loss | None = None,
        data_parallel: Group | None = None,
    ) -> None:
        self.mesh = mesh = group if isinstance(group, Mesh) else None
        if mesh is not None:
            group, data_parallel = mesh.pp, mesh.dp
        assert isinstance(group, Group)
        if group.size != config.num_stages:
            raise InvalidArgument(f"{config.num_stages} stages need a group of that size")
        given = list(module) if isinstance(module, Sequence) else [module]
        self._sharded = given[0] if isinstance(given[0], ShardedStage) else None
        if self._sharded is not None and (len(given) > 1 or self._sharded.mesh is not mesh):
            raise InvalidArgument(
                "a sharded stage is one FSDP object made over the pipeline's mesh: "
                "FSDP.create(stage, mesh), then PipelineStage(fsdp, mesh, config)"
            )
        self.chunks: list[Module] = [m.model if isinstance(m, ShardedStage) else m for m in given]
        if len(self.chunks) != config.chunks:
            raise InvalidArgument(
                f"{config.chunks} chunks per rank, got {len(self.chunks)} modules"
            )
        if len(self.chunks) == 1:
            self.module = self.chunks[0]
        else:  # every chunk's parameters, for the data-parallel sum and clipping
            self.module = Module()
            for i, chunk in enumerate(self.chunks):
                self.module.add(str(i), chunk)
        self.group = group
        self.config = config
        self.loss = loss
        self.data_parallel = data_parallel
        self.stage = group.rank
        self.first = self.stage == 0
        self.last = self.stage == group.size - 1
        if self.last and loss is None:
            raise InvalidArgument("the last stage needs a loss")
        self._steps = 0
        self._stashed: dict[tuple[int, int], list[list[object]]] = {}  # (chunk, micro)
        self._outputs: dict[int, np.ndarray] = {}
        self._stages = group.size * config.chunks  # in the whole pipeline
        self._backwards = 0  # backward passes of the step under way

    def _tag(self, micro: int, stage: int, backward: bool) -> int:
        """The tag of the message into ``stage`` (global stage index) for ``micro``."""
        call = self._steps * self.config.num_micro_batches + micro
        return (call * self._stages + stage) * 2 + int(backward)

    def _global(self, chunk: int) -> int:
        return chunk * self.group.size + self.stage

    async def step(self, inputs: np.ndarray | None = None, targets: np.ndarray | None = None):
        """Forward and backward of every micro-batch; returns the summed loss on the last
        stage (None elsewhere). Gradients are added to the stage's modules."""
        xs, ys = self._split(inputs, targets)
        total = 0.0
        c = self.config
        self._backwards = 0
        for kind, chunk, micro in schedules.order(
            c.schedule, c.num_stages, self.stage, c.num_micro_batches, c.chunks
        ):
            if kind == "F":
                await self._forward(chunk, micro, xs[micro])
            else:
                total += await self._backward(chunk, micro, ys[micro])
        self._steps += 1
        if self._sharded is None and self.data_parallel is not None and self.data_parallel.size > 1:
            for _, module in self.module.named_modules():
                for grad in module.grads.values():
                    await self.data_parallel.all_reduce(grad)
        return total if self.last else None

    async def evaluate(
        self,
        inputs: np.ndarray | None = None,
        targets: np.ndarray | None = None,
        *,
        loss: Loss | None = None,
    ) -> float | None:
        """Forward only, micro-batch by micro-batch (no gradients): the summed ``loss``
        (default: the stage's) on the last stage, None elsewhere."""
        xs, ys = self._split(inputs, targets)
        loss = loss or self.loss
        total = 0.0
        for micro in range(self.config.num_micro_batches):
            for chunk in range(self.config.chunks):
                await self._forward(chunk, micro, xs[micro])
                self._stashed.pop((chunk, micro))
            if self.last:
                assert loss is not None
                total += loss(self._outputs.pop(micro), ys[micro])[0]
        self._steps += 1
        return total if self.last else None

    def _split(self, inputs: np.ndarray | None, targets: np.ndarray | None) -> tuple[list, list]:
        m = self.config.num_micro_batches
        if self.first and inputs is None:
            raise InvalidArgument("the first stage needs the inputs")
        if self.last and targets is None:
            raise InvalidArgument("the last stage needs the targets")
        xs = np.array_split(inputs, m) if self.first and inputs is not None else [None] * m
        ys = np.array_split(targets, m) if self.last and targets is not None else [None] * m
        return xs, ys

    async def clip_grad_norm(self, max_norm: float) -> float:
        """After :meth:`step`: scale the stage's gradients so the whole model's L2 norm
        (every stage, every tensor-parallel slice) is at most ``max_norm``; returns the
        norm before clipping, the same on every rank."""
        if self._sharded is not None:
            return await self._sharded.clip_grad_norm(max_norm)
        split, tp = partitioned(self.module)
        sums = [0.0, 0.0]  # replicated, partitioned (complete: data parallel holds copies)
        grads = list(self.module.named_grads())
        for name, grad in grads:
            flat = grad.reshape(-1)
            sums[1 if name in split else 0] += float(np.dot(flat, flat))
        tp = self.mesh.tp if self.mesh is not None else tp
        norm = await global_norm(sums[0], sums[1], tp=tp, pp=self.group)
        scale = clip_scale(norm, max_norm)
        if scale is not None:
            for _, grad in grads:
                np.multiply(grad, scale, out=grad)
        return norm

    async def _forward(self, chunk: int, micro: int, x: np.ndarray | None) -> None:
        g, p = self._global(chunk), self.group.size
        if g > 0:
            x = await self.group.recv((self.stage - 1) % p, tag=self._tag(micro, g, False))
        assert x is not None
        module = self.chunks[chunk]
        if self._sharded is not None:
            y = await self._sharded.forward(x)
        else:
            y = await asyncio.to_thread(module.forward, x)
        self._stashed[chunk, micro] = module.stash()
        if g == self._stages - 1:
            self._outputs[micro] = y
        else:
            out = np.ascontiguousarray(y)
            await self.group.send(out, (self.stage + 1) % p, tag=self._tag(micro, g + 1, False))

    async def _backward(self, chunk: int, micro: int, target: np.ndarray | None) -> float:
        g, p = self._global(chunk), self.group.size
        loss = 0.0
        if g == self._stages - 1:
            assert self.loss is not None and target is not None
            loss, dy = self.loss(self._outputs.pop(micro), target)
        else:
            dy = await self.group.recv((self.stage + 1) % p, tag=self._tag(micro, g, True))
        module = self.chunks[chunk]
        module.unstash(self._stashed.pop((chunk, micro)))
        sharded = self._sharded
        if sharded is not None:  # gradients reduced once, after the last micro-batch
            self._backwards += 1
            last = self._backwards == self.config.num_micro_batches
            with contextlib.nullcontext() if last else sharded.no_sync():
                dx = await sharded.backward(dy)
        else:
            dx = await asyncio.to_thread(module.backward, dy)
        if g > 0:
            out = np.ascontiguousarray(dx)
            await self.group.send(out, (self.stage - 1) % p, tag=self._tag(micro, g - 1, True))
        return loss
