"""Gradient aggregation without FSDP: one interface, three ways to average gradients over
the ranks, and a one-call training step.

* :class:`LocalAggregator`: a single process; gradients pass unchanged.
* :class:`AllReduceAggregator`: every rank's gradients averaged by all-reduce (or by a
  compression codec, see :mod:`shardwire.worker.training.compression`).
* :class:`ParameterServer`: workers send their gradients to the server rank, which
  averages them and sends the average back. With ``dedicated=True`` the server rank
  computes no gradients: it holds the optimizer, applies the averaged gradients of the
  workers and sends them the updated parameters.

Every aggregator can also broadcast the parameters from one rank (at the start, or after
a restore), so all ranks begin alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shardwire.protocol import ShardwireError
from shardwire.worker.collectives import Group
from shardwire.worker.collectives.agree import differing_from_root
from shardwire.worker.nn.module import Module
from shardwire.worker.optim.optimizers import Optimizer
from shardwire.worker.training.compression import Codec


class AggregationError(ShardwireError, ValueError):
    """Aggregator misuse: gradient lists that differ between ranks, or the wrong world."""


def _flat(grads: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(g).reshape(-1) for g in grads])


def _unflat(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for g in like:
        out.append(flat[offset : offset + g.size].reshape(g.shape))
        offset += g.size
    return out


class Aggregator:
    """Averages gradients over the ranks of ``group`` (None: a single process)."""

    def __init__(self, group: Group | None) -> None:
        self.group = group
        self._signature: tuple | None = None
        self.wire_bytes = 0  # gradient bytes this rank sent so far

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    async def _check(self, grads: Sequence[np.ndarray]) -> None:
        """On the first call, every rank must bring the same shapes and dtypes."""
        signature = tuple((tuple(g.shape), str(g.dtype)) for g in grads)
        if self._signature == signature:
            return
        if self._signature is not None:
            raise AggregationError(
                f"gradient list changed: {len(self._signature)} arrays before, "
                f"{len(signature)} now (or their shapes or dtypes)"
            )
        if self.group is not None and self.group.size > 1:
            differ, count = await differing_from_root(self.group, signature)
            if count:
                more = f" and {count - len(differ)} more" if count > len(differ) else ""
                raise AggregationError(
                    f"ranks {differ}{more} bring other gradients (shapes or dtypes) than rank 0"
                )
        self._signature = signature

    async def aggregate(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The average over the ranks of each gradient (new arrays)."""
        raise NotImplementedError

    async def broadcast_params(self, params: Sequence[np.ndarray], *, root: int = 0) -> None:
        """Overwrite every rank's parameters with ``root``'s, in place."""
        if self.group is not None and self.group.size > 1:
            for p in params:
                await self.group.broadcast(p, root=root)


class LocalAggregator(Aggregator):
    """One process: the gradients are already the average."""

    def __init__(self, group: Group | None = None) -> None:
        if group is not None and group.size != 1:
            raise AggregationError(
                f"LocalAggregator is for a single process; this group has {group.size} "
                "ranks (use AllReduceAggregator or ParameterServer)"
            )
        super().__init__(group)

    async def aggregate(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        await self._check(grads)
        return [np.array(g, copy=True) for g in grads]


class AllReduceAggregator(Aggregator):
    """Average by all-reduce, or through ``codec`` (e.g. ``TopK(0.01)``, ``Float16()``)."""

    def __init__(self, group: Group, *, codec: Codec | None = None) -> None:
        super().__init__(group)
        self.codec = codec

    async def aggregate(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        await self._check(grads)
        assert self.group is not None
        if self.codec is None:
            flat = _flat(grads)
            self.wire_bytes += flat.nbytes
            total = await self.group.all_reduce(flat)
            return _unflat(total / self.size, grads)
        out = []
        for index, g in enumerate(grads):
            self.wire_bytes += self.codec.wire_bytes(np.asarray(g))
            out.append(await self.codec.sum(self.group, index, np.asarray(g)) / self.size)
        return out


class ParameterServer(Aggregator):
    """Workers' gradients averaged on the server rank and sent back.

    ``dedicated=True``: the server computes no gradients; only the workers' are averaged,
    and :meth:`serve` (on the server) applies them with the server's optimizer and sends
    the new parameters, which :meth:`receive_params` (on the workers) writes in place.
    """

    def __init__(self, group: Group, *, server: int = 0, dedicated: bool = False) -> None:
        super().__init__(group)
        if not 0 <= server < group.size:
            raise AggregationError(f"server rank {server} is not in a group of {group.size}")
        if dedicated and group.size < 2:
            raise AggregationError("a dedicated server needs at least one worker")
        self.server = server
        self.dedicated = dedicated

    @property
    def is_server(self) -> bool:
        assert self.group is not None
        return self.group.rank == self.server

    @property
    def workers(self) -> int:
        return self.size - 1 if self.dedicated else self.size

    async def _average_on_server(self, flat: np.ndarray | None, like: np.ndarray) -> np.ndarray:
        assert self.group is not None
        mine = flat if flat is not None else np.zeros_like(like)  # a dedicated server adds 0
        if flat is not None:
            self.wire_bytes += flat.nbytes
        gathered = await self.group.gather(mine.reshape(1, -1), root=self.server)
        average = np.empty_like(like)
        if self.is_server:
            assert gathered is not None
            np.copyto(average, gathered.sum(axis=0) / self.workers)
        await self.group.broadcast(average, root=self.server)
        return average

    async def aggregate(self, grads: Sequence[np.ndarray]) -> list[np.ndarray]:
        await self._check(grads)
        if self.dedicated and self.is_server:
            raise AggregationError("a dedicated server does not aggregate; call serve()")
        flat = _flat(grads)
        return _unflat(await self._average_on_server(flat, flat), grads)

    async def serve(self, params: Sequence[np.ndarray], optimizer: Optimizer, **step) -> None:
        """Dedicated server: one step, averaging the workers' gradients and sending back
        the updated parameters."""
        if not (self.dedicated and self.is_server):
            raise AggregationError("serve() is for the dedicated server rank")
        like = _flat(params)
        average = await self._average_on_server(None, like)
        optimizer.step(list(params), _unflat(average, params), **step)
        await self.broadcast_params(params, root=self.server)

    async def receive_params(self, grads: Sequence[np.ndarray], params: Sequence[np.ndarray]):
        """Dedicated server's worker: send ``grads``, then take the server's parameters."""
        if not self.dedicated or self.is_server:
            raise AggregationError("receive_params() is for workers of a dedicated server")
        flat = _flat(grads)
        await self._average_on_server(flat, flat)
        await self.broadcast_params(params, root=self.server)


async def distributed_train_step(
    model: Module,
    batch: tuple[np.ndarray, np.ndarray] | None,
    loss_fn: Callable[[np.ndarray, np.ndarray], tuple[float, np.ndarray]],
    aggregator: Aggregator,
    optimizer: Optimizer,
    **step: Any,
) -> float:
    """Forward, backward, average the gradients over the ranks, and step the optimizer;
    returns this rank's loss. ``loss_fn`` averages over this rank's batch, so the mean of
    the ranks' gradients is the gradient of the mean loss. The numpy work runs in a
    thread. A dedicated parameter server passes no batch: it only applies the average
    (and returns NaN)."""
    params = [p for _, p in model.named_parameters()]
    if isinstance(aggregator, ParameterServer) and aggregator.dedicated and aggregator.is_server:
        await aggregator.serve(params, optimizer, **step)
        return float("nan")
    if batch is None:
        raise AggregationError("every rank but a dedicated server needs a batch")
    inputs, targets = batch
    model.zero_grad()
    out = await asyncio.to_thread(model.forward, inputs)
    loss, dy = loss_fn(out, targets)
    await asyncio.to_thread(model.backward, dy)
    grads = [g for _, g in model.named_grads()]
    if isinstance(aggregator, ParameterServer) and aggregator.dedicated:
        await aggregator.receive_params(grads, params)
        return loss
    averaged = await aggregator.aggregate(grads)
    optimizer.step(params, averaged, **step)
    return loss
