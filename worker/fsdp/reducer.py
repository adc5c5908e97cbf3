"""Gradient reductions started during backward and collected at its end.

Sharded strategies reduce-scatter each unit's full gradient as soon as the unit's
backward is done; NO_SHARD packs consecutive units into buckets of at least
``bucket_bytes`` and all-reduces each bucket. Both run without waiting, overlapping the
rest of backward. Each unit's backward first collects the reductions already done (so
their full gradients are dropped early) and, with ``reduce_depth``, waits for the oldest
while more are in flight. ``finish`` collects them in the order they were started; for
HYBRID_SHARD it starts each shard's all-reduce across its replica group as soon as the
shard is there, and waits for all of them together. Every rank issues the same
collectives in the same order. The units' gradient states move only through
:meth:`Unit.start_reduce` and :meth:`Unit.finish_reduce`.
"""

from __future__ import annotations

import numpy as np

from shardwire.worker.collectives import Work
from shardwire.worker.fsdp.config import FSDPConfig
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.unit import Unit


class Reducer:
    def __init__(self, config: FSDPConfig) -> None:
        self.config = config
        self._pending: list[tuple[list[Unit], Work[np.ndarray]]] = []
        self._replicas: list[tuple[Unit, Work[np.ndarray]]] = []
        self._bucket: list[Unit] = []
        self._bucket_bytes = 0

    def add(self, unit: Unit, grad: np.ndarray | None = None) -> None:
        """Start reducing the unit's full gradient (or ``grad``) into its shard."""
        full = unit.start_reduce(grad)
        if self.config.compression is not None:  # exchanged in finish(), one at a time
            self._bucket.append(unit)
            return
        if self.config.strategy is Strategy.NO_SHARD:
            self._bucket.append(unit)
            self._bucket_bytes += full.nbytes
            if self._bucket_bytes >= self.config.bucket_bytes:
                self.flush()
            return
        wire = self._wire(full)
        self._pending.append(([unit], unit.shard_group.reduce_scatter(wire).start()))

    def _wire(self, grad: np.ndarray) -> np.ndarray:
        dtype = self.config.mixed_precision.reduce(grad.dtype)
        return grad if dtype == grad.dtype else grad.astype(dtype)

    def flush(self) -> None:
        """Start the all-reduce of the NO_SHARD bucket being filled."""
        if not self._bucket:
            return
        units, self._bucket, self._bucket_bytes = self._bucket, [], 0
        flat = np.concatenate([self._wire(u.start_reduce()) for u in units])
        self._pending.append((units, units[0].shard_group.all_reduce(flat).start()))

    async def finish(self) -> None:
        codec = self.config.compression
        if codec is not None:
            units, self._bucket = self._bucket, []
            for unit in units:  # sequential: a codec makes several calls per tensor
                index = id(unit)  # the codec's per-tensor state (the top-k residual)
                total = await codec.sum(unit.shard_group, index, unit.start_reduce())
                unit.finish_reduce(total)
            return
        self.flush()
        await self.settle(0)
        while self._replicas:
            unit, work = self._replicas[0]
            unit.finish_reduce(await work.wait())
            self._replicas.pop(0)

    async def settle(self, keep: int | None) -> None:
        """Collect, in order, the reductions that are done, and wait for the oldest while
        more than ``keep`` are in flight (None: no bound). A failed one stays pending for
        :meth:`cancel`."""
        while self._pending:
            units, work = self._pending[0]
            if not work.done() and (keep is None or len(self._pending) <= keep):
                return
            reduced = await work.wait()
            self._pending.pop(0)
            offset = 0
            for unit in units:
                size = unit.grad_shard.size
                part = reduced[offset : offset + size]
                offset += size
                if unit.replica_group is not None and unit.replica_group.size > 1:
                    self._replicas.append(
                        (unit, unit.replica_group.all_reduce(part.copy()).start())
                    )
                else:
                    unit.finish_reduce(part)

    def cancel(self) -> None:
        for units, work in self._pending:
            work.cancel()
            for unit in units:
                unit.abandon_reduce()
        for unit, work in self._replicas:
            work.cancel()
            unit.abandon_reduce()
        for unit in self._bucket:
            unit.abandon_reduce()
        self._pending, self._replicas, self._bucket = [], [], []
        self._bucket_bytes = 0
