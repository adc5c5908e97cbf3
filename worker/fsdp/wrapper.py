"""Fully sharded data parallel training over a process group.

Theory of operation
-------------------
The model is cut into *units* by a policy (e.g. every transformer block); parameters
that no unit claims form the *root* unit. Each unit owns one flat, padded buffer (see
``flatparams.py``) of which each rank keeps a shard.

``forward`` runs the model's own numpy code in a worker thread, so the event loop stays
free to move bytes while numpy computes. Each unit's ``forward``/``backward`` is wrapped
by a hook that hops to the event loop: before a unit computes, its parameters are
gathered (one all-gather per unit) and the next units' gathers are started (prefetch,
bounded by depth and bytes); after it computes, FULL_SHARD frees them again. Backward
walks the units in reverse: re-gather, compute, then *start* the unit's gradient
reduce-scatter (or all-reduce for NO_SHARD) without waiting, so it overlaps the next
unit's backward. The end of ``backward`` collects the reductions in unit order (then,
for HYBRID_SHARD, all-reduces each shard across the replica groups). Every rank issues
the same collectives in the same order, because the hooks run in model order.

The optimizer updates flat shards only; SHARD_GRAD_OP gathers the updated shards back
into its full parameters after each step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.protocol.errors import InvalidArgument, ShardwireError
from shardwire.worker.collectives import Group
from shardwire.worker.collectives.agree import differing_from_root
from shardwire.worker.collectives.threads import LoopBridge
from shardwire.worker.fsdp import checkpoint, footprint, norms
from shardwire.worker.fsdp.config import FSDPConfig
from shardwire.worker.fsdp.flatparams import FlatLayout
from shardwire.worker.fsdp.hooks import hook_module
from shardwire.worker.fsdp.offload import OffloadStore, return_free_memory
from shardwire.worker.fsdp.partition import fingerprint, owned, partition
from shardwire.worker.fsdp.persist import Checkpointer, Resumed
from shardwire.worker.fsdp.reducer import Reducer
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.unit import Unit, UnitState
from shardwire.worker.nn.module import Module
from shardwire.worker.observe.trace import span
from shardwire.worker.optim.optimizers import Optimizer
from shardwire.worker.parallelism import Mesh


class FSDPError(ShardwireError, RuntimeError):
    """Misuse of the wrapper (the message says what to do instead)."""


class FSDP:
    """Wrap ``model`` for sharded training on ``group``; build with :meth:`create`."""

    def __init__(
        self,
        model: Module,
        group: Group,
        *,
        optimizer: Optimizer,
        config: FSDPConfig,
        mesh: Mesh | None = None,
    ) -> None:
        self.model = model
        self.group = group
        self.mesh = mesh  # the layout this model is part of, if any (shards over its dp)
        self.config = config
        self.strategy = config.strategy
        self.optimizer = optimizer
        self.prefetch_enabled = config.prefetch
        self.prefetch_depth = config.prefetch_depth
        self.prefetch_bytes = config.prefetch_bytes
        self.shard_group, self.replica_group = self._groups(config.shard_size)
        self.offload = None if config.offload is None else OffloadStore(config.offload)
        roots = partition(model, config.policy)
        inside = {id(m) for _, r in roots for _, m in r.named_modules()}
        root_owned = [
            ((f"{path}.{local}" if path else local), owner, local)
            for path, owner in model.named_modules()
            if id(owner) not in inside
            for local in owner.params
        ]
        self.root = self._unit("", root_owned)
        self.units = [self._unit(name, owned(name, m)) for name, m in roots]
        if self.offload is not None and self.offload.offload.optimizer:
            optimizer.slot_factory = self.offload.slot
            optimizer.set_state(optimizer.state)  # state it already holds moves to files
        self._sync = True
        # The compute thread reaches the loop FSDP was created on (create() is async).
        self._bridge = LoopBridge(asyncio.get_running_loop(), timeout=group.timeout)
        self._reducer = Reducer(config)
        self._checkpointer: Checkpointer | None = None
        self._prefetched = False
        for index, (_, module) in enumerate(roots):
            self._hook(module, index)
        return_free_memory()  # the unsharded parameters just freed

    @classmethod
    async def create(
        cls, model: Module, group: Group | Mesh, *, optimizer: Optimizer, **options: Any
    ) -> FSDP:
        """Check that every rank wraps the same model, then shard it over ``group`` (or a
        :class:`~shardwire.worker.parallelism.Mesh`'s data-parallel group ``dp``).

        ``options`` are the fields of :class:`FSDPConfig` (strategy, policy, prefetch,
        prefetch_depth, prefetch_bytes, shard_size, mixed_precision, bucket_bytes,
        reduce_depth, compression, offload).
        """
        if "strategy" in options:
            options["strategy"] = Strategy(options["strategy"])
        config = FSDPConfig(**options)
        mesh = group if isinstance(group, Mesh) else None
        group = group.dp if isinstance(group, Mesh) else group
        differ, count = await differing_from_root(group, fingerprint(model))
        if count:
            more = f" and {count - len(differ)} more" if count > len(differ) else ""
            raise FSDPError(
                f"model on rank(s) {differ}{more} differs from rank 0's (parameter "
                "names, shapes or dtypes); build the same model everywhere"
            )
        return cls(model, group, optimizer=optimizer, config=config, mesh=mesh)

    def _groups(self, shard_size: int | None) -> tuple[Group, Group | None]:
        if self.strategy is not Strategy.HYBRID_SHARD:
            return self.group, None
        size = shard_size or getattr(self.group, "local_world_size", None)
        if not size or self.group.size % size:
            raise FSDPError(
                f"HYBRID_SHARD needs a shard group size dividing the world "
                f"size {self.group.size}, got {size}"
            )
        r = self.group.rank
        start = r - r % size
        shard = self.group.new_group(range(start, start + size), name="fsdp-shard")
        replica = self.group.new_group(range(r % size, self.group.size, size), name="fsdp-replica")
        return shard, replica

    def _unit(self, name: str, owned: list[tuple[str, Module, str]]) -> Unit:
        layout = FlatLayout.build(owned, self.shard_group.size)
        return Unit(
            name,
            layout,
            strategy=self.strategy,
            shard_group=self.shard_group,
            replica_group=self.replica_group,
            param_dtype=self.config.mixed_precision.param(layout.dtype),
            spill=None if self.offload is None else self.offload.unit(),
            offload=self.config.offload,
        )

    # ---- hooks (see hooks.py) --------------------------------------------------------

    def _hook(self, module: Module, index: int) -> None:
        unit = self.units[index]
        hook_module(
            module,
            self._bridge,
            before_forward=lambda: self._before_forward(index),
            after_forward=unit.free,
            before_backward=lambda: self._before_backward(index),
            after_backward=lambda: self._after_backward(unit),
        )

    @property
    def gather_wait_s(self) -> float:
        """Seconds the passes waited for all-gathers of parameters to land (what
        prefetch did not hide), since the wrapper was made."""
        return sum(unit.gather_wait_s for unit in self.all_units())

    @property
    def hook_wait_s(self) -> float:
        """Seconds the compute thread was blocked in the units' hooks: all-gather and
        ``reduce_depth`` waits, and its hand-offs to the event loop and back."""
        return self._bridge.wait_s

    def _prefetch_after(self, order: list[int]) -> None:
        if not self.prefetch_enabled:
            return
        budget = self.prefetch_bytes
        in_flight = 0
        for index in order[: self.prefetch_depth]:
            unit = self.units[index]
            if budget is not None and in_flight + unit.gathered_bytes > budget:
                break
            unit.start_gather()
            in_flight += unit.gathered_bytes

    async def _before_forward(self, index: int) -> None:
        await self.units[index].gather()
        self._prefetch_after(list(range(index + 1, len(self.units))))

    async def _before_backward(self, index: int) -> None:
        await self._settle()
        unit = self.units[index]
        await unit.gather()
        self._prefetch_after(list(range(index - 1, -1, -1)))
        unit.begin_backward()

    async def _settle(self) -> None:
        """Before a unit's backward: collect finished reductions; leave room for one more."""
        depth = self.config.reduce_depth
        await self._reducer.settle(None if depth is None else depth - 1)

    def _after_backward(self, unit: Unit) -> None:
        if self._sync:
            self._reducer.add(unit)
        unit.free()

    # ---- training step -----------------------------------------------------------------

    async def forward(self, x: np.ndarray) -> np.ndarray:
        """Run the model forward on this rank's batch."""
        with span("forward", "fsdp"):
            await self.root.gather()
            if not self._prefetched:
                self._prefetch_after(list(range(len(self.units))))
            self._prefetched = False
            y = await asyncio.to_thread(self.model.forward, x)
            self._bridge.raise_pending()
        return y

    def prefetch(self) -> None:
        """Start gathering the first units now (e.g. while the next batch loads): the
        first one, and as many more as ``prefetch_depth`` and ``prefetch_bytes`` allow."""
        if not self.strategy.shards_params:
            raise FSDPError(f"{self.strategy.name} keeps full parameters: nothing to prefetch")
        if self._prefetched:
            raise FSDPError("prefetch() called twice without a forward in between")
        self._prefetched = True
        self.root.start_gather()
        if self.units:
            self.units[0].start_gather()
        self._prefetch_after(list(range(len(self.units))))

    async def backward(self, dy: np.ndarray) -> np.ndarray:
        """Backward from the loss gradient; returns once gradients are reduced (or, in
        ``no_sync``, accumulated locally)."""
        with span("backward", "fsdp"):
            await self.root.gather()
            self.root.begin_backward()
            try:
                dx = await asyncio.to_thread(self.model.backward, dy)
                self._bridge.raise_pending()
                if self._sync:
                    with span("reduce-scatter wait", "fsdp"):
                        await self._settle()
                        self._reducer.add(self.root)
                        await self._reducer.finish()
            except BaseException:
                self._reducer.cancel()
                raise
            finally:
                self.root.free()
        return dx

    async def sync_gradients(self, grads: dict[str, np.ndarray]) -> None:
        """Add gradients computed outside the wrapper (full arrays by parameter name,
        this rank's contribution), reduced over the ranks like backward's."""
        for unit in self.all_units():
            flat = np.zeros(unit.layout.padded, unit.layout.dtype)
            for e in unit.layout.entries:
                if e.name in grads:
                    value = np.asarray(grads[e.name])
                    if value.shape != e.shape:
                        raise InvalidArgument(
                            f"gradient {e.name} has shape {value.shape}, the parameter {e.shape}"
                        )
                    flat[e.offset : e.offset + e.numel] = value.reshape(-1)
            self._reducer.add(unit, flat)
        await self._reducer.finish()

    def shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(parameter shard, gradient shard) per unit, for an external optimizer."""
        return [(u.shard, u.grad_shard) for u in self.all_units()]

    async def update_shards(self, values: list[np.ndarray]) -> None:
        """Replace this rank's parameter shards (one flat array per unit, sizes checked)."""
        units = self.all_units()
        if len(values) != len(units):
            raise InvalidArgument(f"expected {len(units)} shards (one per unit), got {len(values)}")
        for unit, value in zip(units, values, strict=True):
            if np.shape(value) != unit.shard.shape:
                raise InvalidArgument(
                    f"unit {unit.name or '<root>'}: expected a shard of "
                    f"{unit.shard.size} values, got shape {np.shape(value)}"
                )
        for unit, value in zip(units, values, strict=True):
            unit.shard[...] = value
            if self.strategy is Strategy.SHARD_GRAD_OP:
                await unit.resync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) until the context exits; the
        next synced backward reduces the sum."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def all_units(self) -> list[Unit]:
        return [self.root, *self.units]

    async def step(self, *, lr: float | None = None) -> None:
        """Apply the optimizer to this rank's shards."""
        units = self.all_units()

        def done(i: int) -> None:  # offload: keep about one unit's state resident
            units[i].page_out()
            if i + 1 < len(units):
                units[i + 1].page_in()

        with span("optimizer", "fsdp"):
            units[0].page_in()
            shards, grads = [u.shard for u in units], [u.grad_shard for u in units]
            self.optimizer.step(shards, grads, lr=lr, after=done)
            if self.strategy is Strategy.SHARD_GRAD_OP:
                for unit in units:
                    await unit.resync()
        if self.offload is not None:
            return_free_memory()  # the step's gathered parameters and full gradients

    def zero_grad(self) -> None:
        for unit in self.all_units():
            unit.zero_grad()

    async def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so the model's global L2 norm is at most ``max_norm``; returns
        the norm before clipping (the same number single-process training computes),
        counting tensor-parallel slices and, with a mesh, every pipeline stage."""
        return await norms.clip_grad_norm(self, max_norm)

    @contextlib.asynccontextmanager
    async def full_params(self) -> AsyncIterator[Module]:
        """Temporarily gather every parameter (e.g. to evaluate or generate)."""
        for unit in self.all_units():
            await unit.gather()
        try:
            yield self.model
        finally:
            for unit in self.all_units():
                unit.free()

    async def aclose(self) -> None:
        """Cancel reductions still in flight (left over after an error) and close the
        groups HYBRID_SHARD created."""
        self._reducer.cancel()
        for group in (self.shard_group, self.replica_group):
            if group is not None and group is not self.group:
                await group.aclose()
        if self.offload is not None:
            self.offload.close()

    async def save(self, directory: str | Path, *, step: int, **options: Any) -> Any:
        """Write a durable, verified checkpoint of ``step`` into ``directory`` (every rank
        calls it). Options: ``extra`` (JSON data, e.g. the data position), ``rngs``
        (generators to save besides the model's own), ``keep`` (retain the newest N),
        ``blocking`` (False: snapshot now, write in the background, return a Work whose
        ``wait()`` gives the SaveReport). See :mod:`shardwire.worker.fsdp.persist`."""
        result = await self._persist().save(directory, step=step, **options)
        for unit in self.all_units():
            unit.page_out()  # the save read every shard
        return result

    async def load(self, directory: str | Path, **options: Any) -> Resumed:
        """Restore the latest complete checkpoint in ``directory`` (or ``step=N``), written
        at any world size with any strategy; returns its step and ``extra``. ``rngs``:
        generators to restore besides the model's own."""
        return await self._persist().load(directory, **options)

    def _persist(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self)
        return self._checkpointer

    async def state_dict(self, *, sharded: bool = False) -> dict[str, Any]:
        """Full parameters by name (every rank gets them), or this rank's pieces."""
        if sharded:
            return checkpoint.sharded_state(self.all_units())
        return await checkpoint.full_state(self.all_units())

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load full parameters by name, or a list of sharded pieces from any world size."""
        await checkpoint.load(self.all_units(), state)

    def memory_stats(self) -> dict[str, dict[str, int]]:
        """Per-rank bytes by category: what the strategy implies between steps
        ("estimated"), what this rank holds in memory ("held"), and what lives in
        offload files ("offloaded")."""
        return footprint.stats(self.all_units(), self.strategy, self.optimizer, self.config.offload)

    def unit_states(self) -> dict[str, UnitState]:
        return {u.name or "<root>": u.state for u in self.all_units()}
