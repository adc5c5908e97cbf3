"""One FSDP unit: its flat parameter shard, gathered parameters and gradients.

States (one place, see ``Unit.state``):

* SHARDED: only this rank's shard is held; module parameters are released.
* GATHERING: an all-gather of the full parameters is in flight (a prefetch).
* FULL: the full parameters are bound to the modules.

Every method here runs on the event loop; the FSDP wrapper calls them from its compute
thread through ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import enum

import numpy as np

from shardwire.worker.collectives import Group, Work
from shardwire.worker.fsdp.flat import FlatLayout
from shardwire.worker.fsdp.strategy import Strategy


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the local shard is held
    GATHERING = "gathering"  # an all-gather is in flight
    FULL = "full"  # full parameters bound to the modules


class Unit:
    """Parameters of one wrapped module, laid out flat and sharded over ``shard_group``."""

    def __init__(
        self,
        name: str,
        layout: FlatLayout,
        *,
        strategy: Strategy,
        shard_group: Group,
        replica_group: Group | None,
        param_dtype: np.dtype | None = None,
    ) -> None:
        self.name = name
        self.layout = layout
        self.strategy = strategy
        self.shard_group = shard_group
        self.replica_group = replica_group
        self.param_dtype = param_dtype or layout.dtype  # dtype parameters are gathered in
        flat = layout.flatten()
        if strategy.shards_grads:
            a, b = layout.shard_range(shard_group.rank)
            self.shard = flat[a:b].copy()
        else:
            self.shard = flat  # NO_SHARD: the "shard" is the whole padded buffer
        self.grad_shard = np.zeros_like(self.shard)
        self.full: np.ndarray | None = None
        self.grad_full: np.ndarray | None = None
        self._gathering: Work | None = None
        self.state = UnitState.SHARDED
        layout.release_grads()
        if strategy.shards_params:
            layout.release_params()
        else:
            self._bind_full(flat if strategy is Strategy.NO_SHARD else flat.copy())

    @property
    def gathered_bytes(self) -> int:
        return self.layout.padded * self.param_dtype.itemsize

    # ---- parameters --------------------------------------------------------------------

    def _bind_full(self, full: np.ndarray) -> None:
        self.full = full
        self.layout.bind_params(full)
        self.state = UnitState.FULL

    def start_gather(self) -> None:
        """Begin gathering the full parameters (no-op unless SHARDED)."""
        if self.state is UnitState.SHARDED:
            source = self.shard
            if self.param_dtype != source.dtype:
                source = source.astype(self.param_dtype)
            self._gathering = self.shard_group.all_gather(source).start()
            self.state = UnitState.GATHERING

    async def gather(self) -> None:
        """Make the full parameters available to the modules."""
        self.start_gather()
        if self.state is UnitState.GATHERING:
            assert self._gathering is not None
            full = await self._gathering.wait()
            self._gathering = None
            self._bind_full(full)

    def free(self) -> None:
        """Drop the gathered parameters (FULL_SHARD/HYBRID after use)."""
        if self.strategy.shards_params and self.state is UnitState.FULL:
            self.full = None
            self.layout.release_params()
            self.state = UnitState.SHARDED

    async def resync(self) -> None:
        """SHARD_GRAD_OP after a step: gather the updated shards into the full params."""
        source = (
            self.shard
            if self.param_dtype == self.shard.dtype
            else (self.shard.astype(self.param_dtype))
        )
        full = await self.shard_group.all_gather(source)
        assert self.full is not None
        np.copyto(self.full, full)

    # ---- gradients ---------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Make sure a full gradient buffer is bound (kept across no_sync micro-batches)."""
        if self.grad_full is None:
            self.grad_full = np.zeros(self.layout.padded, self.layout.dtype)
        self.layout.bind_grads(self.grad_full)

    def zero_grad(self) -> None:
        self.grad_shard.fill(0)
        self.grad_full = None
        self.layout.release_grads()
