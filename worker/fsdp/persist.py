"""Saving and resuming FSDP training: parameters, optimizer state by parameter name, the
optimizer's step count, random generators and user data, at any world size.

Who writes what: every value of a unit's flat buffer is written exactly once. Sharded
strategies write each shard from the first replica that holds it; NO_SHARD, where every
rank holds everything, splits the buffer evenly over the ranks. A loader takes, for its
own range of each unit (its shard, or everything for NO_SHARD), the pieces of the saved
tensors that overlap it, whatever world size and strategy wrote them.

The collectives of a save run on a group of their own, so an asynchronous save can
exchange its digests while training goes on in the main group. One save is in flight
at a time; a new save first waits for the previous one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shardwire.protocol.errors import ShardwireError
from shardwire.worker.collectives import Group, Work
from shardwire.worker.fsdp import reshard, store
from shardwire.worker.fsdp.generators import generator_states, set_generator_states
from shardwire.worker.fsdp.store import CheckpointError
from shardwire.worker.fsdp.unit import Unit
from shardwire.worker.kernels.segments import bounds
from shardwire.worker.nn.parallel import Partition, partitions

if TYPE_CHECKING:
    from shardwire.worker.fsdp.wrapper import FSDP

log = logging.getLogger("shardwire.checkpoint")


@dataclass
class SaveReport:
    """What a save did. ``stall_s``: training time it took (the snapshot, plus the
    whole save when blocking); ``total_s``: until the checkpoint was complete."""

    step: int
    path: Path
    bytes_written: int = 0
    stall_s: float = 0.0
    total_s: float = 0.0


@dataclass
class _Snapshot:
    """A save's copy of this rank's pieces, taken on the loop when save() is called."""

    tensors: dict[str, np.ndarray]
    table: dict[str, dict[str, Any]]
    meta: dict[str, Any]
    extra: dict[str, Any]
    started: float
    stall_s: float


@dataclass
class Resumed:
    """What a load restored: the step and the user data saved with it."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def owned_range(unit: Unit) -> tuple[int, int]:
    """The part of the unit's flat buffer this rank holds (its shard, or all of it)."""
    if unit.strategy.shards_grads:
        return unit.layout.shard_range(unit.shard_group.rank)
    return 0, unit.layout.padded


def _written_range(unit: Unit, group: Group) -> tuple[int, int]:
    """The part of the unit's flat buffer this rank writes (possibly empty)."""
    if unit.strategy.shards_grads:
        replica = unit.replica_group
        if replica is not None and replica.rank != 0:
            return 0, 0
        return unit.layout.shard_range(unit.shard_group.rank)
    return bounds(unit.layout.padded, group.size)[group.rank]


async def _attempt(fn: Any, *args: Any, **kwargs: Any) -> str | None:
    """Run a file operation in a thread; the error's text if it failed, else None."""
    try:
        await asyncio.to_thread(fn, *args, **kwargs)
    except OSError as exc:
        return f"rank 0: {exc}"
    return None


async def _agree(errors: list[str | None], step: int) -> None:
    """Raise on every rank if any rank reported an error."""
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"the checkpoint of step {step} was not saved: {failed[0]}")


def _overlaps(unit: Unit, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
    """(name, start in the parameter, position in the flat buffer, count) of each
    parameter's values within the flat range ``lo``..``hi``."""
    for e in unit.layout.entries:
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a < b:
            yield e.name, a - e.offset, a, b - a


class Checkpointer:
    """Save and load for one FSDP object (see :meth:`FSDP.save` and :meth:`FSDP.load`).

    With a mesh of several tensor-parallel slices or pipeline stages, the checkpoint's
    group is every rank of the mesh: each stage writes its own parameters (under the
    whole model's names, e.g. ``TransformerLM.pipeline_stage``) and each slice its
    slices (see ``fsdp.reshard``), so it loads under any other layout."""

    def __init__(self, fsdp: FSDP):
        self._fsdp = fsdp
        self._parts, tp = partitions(fsdp.model)
        self._slice = 0 if tp is None else tp.rank  # this rank's slice of split parameters
        group, mesh = fsdp.group, fsdp.mesh
        if tp is not None and tp.size > 1 and (mesh is None or mesh.tp is not tp):
            raise CheckpointError(
                "a model split over a tensor-parallel group saves and loads through its "
                "mesh: FSDP.create(model, mesh) with the mesh the layers were built on"
            )
        if mesh is not None and (mesh.tp.size > 1 or mesh.pp.size > 1):
            group = mesh.group
        self._stages = None if mesh is None or mesh.pp.size == 1 else mesh.pp
        self._group = group.new_group(range(group.size), name="checkpoint")
        self._inflight: Work[SaveReport] | None = None

    # ---- save --------------------------------------------------------------------------

    def _snapshot(self) -> tuple[dict[str, np.ndarray], dict[str, dict[str, Any]]]:
        """Copies of this rank's pieces, and their place in the tensors (on the loop)."""
        fsdp = self._fsdp
        optimizer = fsdp.optimizer
        tensors: dict[str, np.ndarray] = {}
        table: dict[str, dict[str, Any]] = {}
        for index, unit in enumerate(fsdp.all_units()):
            lo, _hi = owned_range(unit)
            a, b = _written_range(unit, fsdp.group)
            slots = optimizer.state[index] if index < len(optimizer.state) else {}
            shapes = {e.name: list(e.shape) for e in unit.layout.entries}
            for name, start, flat_at, count in _overlaps(unit, a, b):
                part = self._parts.get(name)
                if part is None and self._slice != 0:
                    continue  # held alike by every slice: the first slice's ranks write it
                at = flat_at - lo  # this rank holds the flat values from lo on
                sources = {f"param:{name}": unit.shard}
                sources.update({f"optim:{slot}:{name}": arr for slot, arr in slots.items()})
                for base, source in sources.items():
                    key = base if part is None else reshard.slice_key(base, self._slice)
                    tensors[key] = source[at : at + count].copy()
                    table[key] = {
                        "shape": shapes[name],
                        "dtype": str(source.dtype),
                        "start": start,
                        "count": count,
                    }
                    if part is not None:
                        table[key]["partition"] = part.describe()
        return tensors, table

    async def save(
        self,
        directory: str | Path,
        *,
        step: int,
        extra: dict[str, Any] | None = None,
        rngs: dict[str, np.random.Generator] | None = None,
        keep: int | None = None,
        blocking: bool = True,
    ) -> Work[SaveReport] | SaveReport:
        """Save a checkpoint of ``step``; ``blocking=False`` returns a Work to await."""
        if self._inflight is not None:
            await self._inflight.wait()  # one save in flight at a time
        started = time.perf_counter()
        fsdp = self._fsdp
        tensors, table = self._snapshot()
        generators = generator_states(fsdp, rngs or {})
        meta = {
            "steps": fsdp.optimizer.steps,
            "optimizer": type(fsdp.optimizer).__name__,
            "rngs": generators,
        }
        snap = _Snapshot(tensors, table, meta, extra or {}, started, time.perf_counter() - started)
        work = self._group.spawn(self._write(Path(directory), step, snap, keep=keep))
        if blocking:
            report = await work.wait()
            report.stall_s = report.total_s
            return report
        self._inflight = work
        return work

    async def _write(
        self, root: Path, step: int, snap: _Snapshot, *, keep: int | None
    ) -> SaveReport:
        """Every rank writes its file; rank 0 commits. A failure anywhere (a full disk, a
        directory that cannot be written) is told to every rank, which all raise
        CheckpointError at once; the previous checkpoint stays the latest."""
        group = self._group
        nonce = await group.broadcast_object(secrets.token_hex(8) if group.rank == 0 else None)
        partial = root / f"{store.PARTIAL}{step:08d}-{nonce}"
        prepared = None
        if group.rank == 0:
            prepared = await _attempt(store.prepare, root, keep_nonce=nonce)
        await _agree([await group.broadcast_object(prepared)], step)
        error = None
        try:
            written = await asyncio.to_thread(
                store.write_rank_file, partial, group.rank, snap.tensors, nonce
            )
            for key, info in written.items():
                snap.table[key].update(info, file=store.rank_file(group.rank))
        except OSError as exc:
            error = f"rank {group.rank}: {exc}"
        # only rank 0 writes the manifest: it gathers the tables, then tells every rank
        # the first error, if any (bytes grow with the ranks, not with their square)
        everyone = await group.gather_object(
            {"table": snap.table, "meta": snap.meta, "error": error}
        )
        first = next((e["error"] for e in everyone if e["error"]), None) if everyone else None
        await _agree([await group.broadcast_object(first)], step)
        path = root / store.step_name(step)
        committed = None
        if everyone is not None:  # rank 0
            manifest = self._manifest(step, nonce, everyone, snap.extra)
            committed = await _attempt(store.commit, root, partial, step, manifest)
            if committed is None and keep is not None:
                kept = await _attempt(store.retain, root, keep)
                if kept is not None:  # the new checkpoint is complete; old ones linger
                    log.warning("checkpoint retention in %s failed: %s", root, kept)
        # every rank returns once the checkpoint is complete, or raises with rank 0
        await _agree([await group.broadcast_object(committed)], step)
        nbytes = sum(a.nbytes for a in snap.tensors.values())
        return SaveReport(step, path, nbytes, snap.stall_s, time.perf_counter() - snap.started)

    def _manifest(
        self, step: int, nonce: str, everyone: list[dict[str, Any]], extra: dict[str, Any]
    ) -> dict[str, Any]:
        fsdp = self._fsdp
        tensors: dict[str, dict[str, Any]] = {}
        for part in everyone:
            for key, piece in part["table"].items():
                entry = tensors.setdefault(
                    key, {"shape": piece["shape"], "dtype": piece["dtype"], "pieces": []}
                )
                if "partition" in piece:
                    entry["partition"] = piece["partition"]
                entry["pieces"].append(
                    {k: piece[k] for k in ("file", "start", "count", "bytes", "digest")}
                )
        for entry in tensors.values():
            entry["pieces"].sort(key=lambda p: p["start"])
        first = everyone[0]["meta"]
        return {
            "format_version": store.FORMAT_VERSION,
            "nonce": nonce,
            "step": step,
            "world_size": self._group.size,
            "tp": max((p.of for p in self._parts.values()), default=1),
            "strategy": fsdp.strategy.value,
            "optimizer": {"kind": first["optimizer"], "steps": first["steps"]},
            "rngs": {str(rank): part["meta"]["rngs"] for rank, part in enumerate(everyone)},
            "extra": extra,
            "created": time.time(),
            "tensors": tensors,
        }

    # ---- load --------------------------------------------------------------------------

    async def _settled(self) -> None:
        """Let a save in flight finish first: it speaks on the checkpoint group too, and
        each rank would otherwise interleave its messages with the load's differently.
        How it ended is its own Work's to report (a failed save leaves the previous
        checkpoint, which the load then reads)."""
        if self._inflight is None:
            return
        inflight, self._inflight = self._inflight, None
        try:
            await inflight.wait()
        except ShardwireError as exc:
            log.warning("loading after a checkpoint save that failed: %s", exc)

    async def load(
        self,
        directory: str | Path,
        *,
        step: int | None = None,
        rngs: dict[str, np.random.Generator] | None = None,
    ) -> Resumed:
        """Restore the latest complete checkpoint (or ``step``) written at any world size
        with any strategy. Every rank reads only the pieces overlapping what it holds and
        checks their digests; nothing is changed unless every rank read everything."""
        fsdp = self._fsdp
        await self._settled()
        failure: Exception | None = None
        known = {e.name for unit in fsdp.all_units() for e in unit.layout.entries}
        if self._stages is not None:  # the other stages' parameters are known too
            for names in await self._stages.all_gather_object(sorted(known)):
                known.update(names)
        try:
            path, manifest, shards, state = await asyncio.to_thread(
                self._read, Path(directory), step, known
            )
        except Exception as exc:  # every rank hears of it before any rank goes on
            failure = exc
        problem = None if failure is None else f"rank {self._group.rank}: {failure}"
        every = await self._group.gather_object(problem)  # rank 0 hears, then tells all
        first = next((p for p in every if p), None) if every is not None else None
        problems = [p for p in [await self._group.broadcast_object(first)] if p]
        if failure is not None:
            raise failure
        if problems:
            raise CheckpointError(f"the checkpoint could not be loaded: {problems[0]}")
        for unit, shard in zip(fsdp.all_units(), shards, strict=True):
            unit.shard[...] = shard
            await unit.reload()
        fsdp.optimizer.set_state(state)
        for unit in fsdp.all_units():
            unit.page_out()
        fsdp.optimizer.steps = int(manifest["optimizer"]["steps"])
        set_generator_states(fsdp, rngs or {}, manifest["rngs"].get(str(self._group.rank), {}))
        return Resumed(int(manifest["step"]), dict(manifest.get("extra", {})), path)

    def _read(
        self, root: Path, step: int | None, known: set[str]
    ) -> tuple[Path, dict[str, Any], list[np.ndarray], list[dict[str, np.ndarray]]]:
        """Everything this rank loads, read and verified (in a thread); ``known``: the
        names of the whole model's parameters (every pipeline stage's)."""
        path = store.resolve(root, step)
        manifest = store.read_manifest(path)
        self._check_model(manifest, known)
        tensors = manifest["tensors"]
        optimizer = self._fsdp.optimizer
        slots = sorted({k.split(":")[1] for k in tensors if k.startswith("optim:")})
        if slots and manifest["optimizer"]["kind"] != type(optimizer).__name__:
            raise CheckpointError(
                f"{path} holds {manifest['optimizer']['kind']} state; the optimizer here is "
                f"{type(optimizer).__name__}"
            )
        shards: list[np.ndarray] = []
        state: list[dict[str, np.ndarray]] = []
        with store.PieceReader(path, manifest["nonce"]) as reader:
            source = reshard.SplitReader(reader, reshard.Saved(tensors), self._parts, self._slice)
            for unit in self._fsdp.all_units():
                shard = np.zeros_like(unit.shard)
                fill(source, unit, "param:{}", shard)
                shards.append(shard)
                unit_state = {}
                for slot in slots:
                    unit_state[slot] = np.zeros_like(unit.shard)
                    fill(source, unit, f"optim:{slot}:{{}}", unit_state[slot])
                state.append(unit_state)
        return path, manifest, shards, state if slots else []

    def _check_model(self, manifest: dict[str, Any], known: set[str]) -> None:
        tensors = manifest["tensors"]
        table = reshard.Saved(tensors)
        for unit in self._fsdp.all_units():
            for e in unit.layout.entries:
                saved = table.shape(f"param:{e.name}")
                if saved is None:
                    raise CheckpointError(f"the checkpoint has no parameter {e.name!r}")
                part: Partition | None = self._parts.get(e.name)
                shape = e.shape if part is None else part.full_shape(e.shape)
                if saved != (shape, str(unit.layout.dtype)):
                    raise CheckpointError(
                        f"parameter {e.name!r} is {saved[1]}{list(saved[0])} in the "
                        f"checkpoint, {unit.layout.dtype}{list(shape)} in the model"
                    )
        unknown = sorted({reshard.base_of(k).split(":")[-1] for k in tensors} - known)
        if unknown:
            raise CheckpointError(f"the checkpoint has parameters the model lacks: {unknown}")


def fill(source: reshard.SplitReader, unit: Unit, pattern: str, target: np.ndarray) -> None:
    """Fill ``target`` (this rank's part of the unit's flat buffer) with the saved values
    of ``pattern`` (``param:{}`` or ``optim:SLOT:{}``, formatted with each name)."""
    lo, hi = owned_range(unit)
    for name, start, flat_at, count in _overlaps(unit, lo, hi):
        at = flat_at - lo
        target[at : at + count] = source.values(pattern.format(name), name, start, count)
