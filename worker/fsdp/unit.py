"""One FSDP unit: its flat parameter shard, gathered parameters and gradients.

Parameter states (``Unit.state``):

* SHARDED: only this rank's shard is held; module parameters are released.
* GATHERING: an all-gather of the full parameters is in flight (a prefetch).
* FULL: the full parameters are bound to the modules.

Gradient states (``Unit.grad_state``); ``grad_shard`` always holds the reduced sum so far:

* IDLE: no full gradient is held.
* ACCUMULATING: a full gradient buffer is bound to the modules; backward adds into it
  (and keeps it across ``no_sync`` micro-batches).
* REDUCING: the full gradient's reduction is in flight; when it lands it is added to
  ``grad_shard`` and the unit is IDLE again.

Every method here runs on the event loop; the FSDP wrapper calls them from its compute
thread through ``run_coroutine_threadsafe``.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from shardwire.protocol.errors import InvalidState
from shardwire.worker.collectives import Group, Work
from shardwire.worker.fsdp.flatparams import FlatLayout
from shardwire.worker.fsdp.offload import Offload, UnitSpill
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.observe.trace import span

_IN_MEMORY = Offload(params=False, grads=False, optimizer=False)


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only the local shard is held
    GATHERING = "gathering"  # an all-gather is in flight
    FULL = "full"  # full parameters bound to the modules


class GradState(enum.Enum):
    IDLE = "idle"  # no full gradient held
    ACCUMULATING = "accumulating"  # full gradient bound; backward writes into it
    REDUCING = "reducing"  # its reduction is in flight


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
        spill: UnitSpill | None = None,
        offload: Offload | None = None,
    ) -> None:
        self.name = name
        self.layout = layout
        self.strategy = strategy
        self.shard_group = shard_group
        self.replica_group = replica_group
        self.param_dtype = param_dtype or layout.dtype  # dtype parameters are gathered in
        self.spill = spill  # offloaded arrays of this unit, paged per use
        spilled = offload if spill is not None and offload is not None else _IN_MEMORY
        flat = layout.flatten()
        if strategy.shards_grads:
            a, b = layout.shard_range(shard_group.rank)
            shard = flat[a:b]
        else:
            shard = flat  # NO_SHARD: the "shard" is the whole padded buffer
        if spill is not None and spilled.params:
            shard = spill.array(shard, copy=True)
        elif shard is not flat:
            shard = shard.copy()
        self.shard = shard
        if spill is not None and spilled.grads:
            self.grad_shard = spill.array(self.shard, copy=False)
        else:
            self.grad_shard = np.zeros_like(self.shard)
        self.full: np.ndarray | None = None
        self.grad_full: np.ndarray | None = None
        self._gathering: Work[np.ndarray] | None = None
        self.state = UnitState.SHARDED
        self.gather_wait_s = 0.0  # time ``gather`` waited for an all-gather to land
        self.grad_state = GradState.IDLE
        layout.release_grads()
        if strategy.shards_params:
            layout.release_params()
        else:
            self._bind_full(self.shard if strategy is Strategy.NO_SHARD else flat.copy())
        self.page_out()

    def page_out(self) -> None:
        """Drop this unit's offloaded pages from memory (they stay in their files)."""
        if self.spill is not None:
            self.spill.page_out()

    def page_in(self) -> None:
        """Start reading this unit's offloaded pages back (read-ahead)."""
        if self.spill is not None:
            self.spill.page_in()

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
            self.page_in()
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
            start = time.perf_counter()
            with span(f"all-gather wait {self.name or 'root'}", "fsdp"):
                full = await self._gathering.wait()
            self.gather_wait_s += time.perf_counter() - start
            self._gathering = None
            self._bind_full(full)
            self.page_out()

    def free(self) -> None:
        """Drop the gathered parameters (FULL_SHARD/HYBRID after use)."""
        if self.strategy.shards_params and self.state is UnitState.FULL:
            self.full = None
            self.layout.release_params()
            self.state = UnitState.SHARDED
        self.page_out()  # NO_SHARD computed with offloaded parameters

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
        self.page_out()

    async def reload(self) -> None:
        """The shard was replaced (a checkpoint was loaded): refresh what derives from it."""
        if self.state is UnitState.GATHERING:
            await self.gather()  # an all-gather of the old values: let it land, then drop it
        if self.strategy is Strategy.SHARD_GRAD_OP:
            await self.resync()
        elif self.strategy.shards_params:
            self.free()  # the next use gathers the new values

    # ---- gradients ---------------------------------------------------------------------

    def begin_backward(self) -> None:
        """IDLE -> ACCUMULATING: bind a full gradient buffer (kept across no_sync)."""
        if self.grad_state is GradState.REDUCING:
            raise InvalidState(f"unit {self.name or '<root>'}: backward while reducing")
        if self.grad_full is None:
            self.grad_full = np.zeros(self.layout.padded, self.layout.dtype)
        self.layout.bind_grads(self.grad_full)
        self.grad_state = GradState.ACCUMULATING

    def start_reduce(self, grad: np.ndarray | None = None) -> np.ndarray:
        """-> REDUCING: the full gradient to reduce (the accumulated one, or ``grad``
        given from outside backward)."""
        if grad is not None:
            self.grad_full = grad
        if self.grad_full is None:
            raise InvalidState(f"unit {self.name or '<root>'}: no gradient to reduce")
        self.grad_state = GradState.REDUCING
        return self.grad_full

    def finish_reduce(self, reduced: np.ndarray) -> None:
        """REDUCING -> IDLE: add this rank's reduced part to ``grad_shard``."""
        assert self.grad_state is GradState.REDUCING
        self.grad_shard += reduced
        self._drop_full_grad()
        self.page_out()

    def _drop_full_grad(self) -> None:
        self.grad_full = None
        self.layout.release_grads()
        self.grad_state = GradState.IDLE

    def abandon_reduce(self) -> None:
        """A reduction was cancelled (after an error): forget the full gradient."""
        if self.grad_state is GradState.REDUCING:
            self._drop_full_grad()

    def zero_grad(self) -> None:
        self.grad_shard.fill(0)
        self._drop_full_grad()
        self.page_out()
