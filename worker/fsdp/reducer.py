"""Gradient reductions started during backward and collected at its end.

Sharded strategies reduce-scatter each unit's full gradient as soon as the unit's
backward is done; NO_SHARD packs consecutive units into buckets of at least
``bucket_bytes`` and all-reduces each bucket. Both run without waiting, overlapping the
rest of backward. ``finish`` collects them in the order they were started (then, for
HYBRID_SHARD, all-reduces each shard across its replica group), so every rank issues
the same collectives in the same order.
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
        self._pending: list[tuple[list[Unit], Work]] = []
        self._bucket: list[Unit] = []
        self._bucket_bytes = 0

    def add(self, unit: Unit, grad: np.ndarray) -> None:
        """Start reducing ``grad`` (the unit's full gradient) into ``unit.grad_shard``."""
        unit.grad_full = grad
        if self.config.strategy is Strategy.NO_SHARD:
            self._bucket.append(unit)
            self._bucket_bytes += grad.nbytes
            if self._bucket_bytes >= self.config.bucket_bytes:
                self.flush()
            return
        wire = self._wire(grad)
        self._pending.append(([unit], unit.shard_group.reduce_scatter(wire).start()))

    def _wire(self, grad: np.ndarray) -> np.ndarray:
        dtype = self.config.mixed_precision.reduce(grad.dtype)
        return grad if dtype == grad.dtype else grad.astype(dtype)

    def flush(self) -> None:
        """Start the all-reduce of the NO_SHARD bucket being filled."""
        if not self._bucket:
            return
        units, self._bucket, self._bucket_bytes = self._bucket, [], 0
        grads = [u.grad_full for u in units if u.grad_full is not None]
        assert len(grads) == len(units)
        flat = np.concatenate([self._wire(g) for g in grads])
        self._pending.append((units, units[0].shard_group.all_reduce(flat).start()))

    async def finish(self) -> None:
        self.flush()
        pending, self._pending = self._pending, []
        for units, work in pending:
            reduced = await work.wait()
            offset = 0
            for unit in units:
                size = unit.grad_shard.size
                part = reduced[offset : offset + size]
                offset += size
                if unit.replica_group is not None and unit.replica_group.size > 1:
                    part = await unit.replica_group.all_reduce(part.copy())
                unit.grad_shard += part
                unit.grad_full = None
                unit.layout.release_grads()

    def cancel(self) -> None:
        for _, work in self._pending:
            work.cancel()
        self._pending = []
        self._bucket = []
        self._bucket_bytes = 0
