"""Saving and loading FSDP parameters: full by name, or sharded by piece.

A sharded state is this rank's pieces of each parameter, each with its start offset in
the parameter's flat form, so pieces saved at one world size can be reassembled at any
other (or by a single process) without knowing the old layout.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.fsdp.unit import Unit


async def _flat(unit: Unit) -> np.ndarray:
    if unit.strategy.shards_grads:
        return await unit.shard_group.all_gather(unit.shard)
    return unit.shard


async def full_state(units: list[Unit]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for unit in units:
        flat = await _flat(unit)
        for entry, view in zip(unit.layout.entries, unit.layout.views(flat), strict=True):
            out[entry.name] = view.copy()
    return out


def sharded_state(units: list[Unit]) -> dict[str, Any]:
    pieces: dict[str, Any] = {}
    for unit in units:
        if unit.strategy.shards_grads:
            lo, hi = unit.layout.shard_range(unit.shard_group.rank)
        else:
            lo, hi = 0, unit.layout.padded
        for e in unit.layout.entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a < b:
                pieces[e.name] = {
                    "start": a - e.offset,
                    "data": unit.shard[a - lo : b - lo].copy(),
                    "shape": list(e.shape),
                }
    return {"pieces": pieces}


def assemble(states: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Full parameters from every rank's sharded state (in any order)."""
    flat: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    filled: dict[str, int] = {}
    for state in states:
        for name, piece in state["pieces"].items():
            data = np.asarray(piece["data"])
            shapes[name] = tuple(piece["shape"])
            target = flat.setdefault(name, np.zeros(int(np.prod(shapes[name])), data.dtype))
            target[piece["start"] : piece["start"] + data.size] = data
            filled[name] = filled.get(name, 0) + data.size
    for name, array in flat.items():
        if filled[name] != array.size:
            raise InvalidArgument(f"{name}: the pieces cover {filled[name]} of {array.size} values")
    return {name: array.reshape(shapes[name]) for name, array in flat.items()}


async def load(units: list[Unit], state: dict[str, Any] | list[dict[str, Any]]) -> None:
    full = assemble(state) if isinstance(state, list) else state
    for unit in units:
        flat = np.zeros(unit.layout.padded, unit.layout.dtype)
        for e in unit.layout.entries:
            if e.name not in full:
                raise InvalidArgument(f"state has no parameter {e.name!r}")
            value = np.asarray(full[e.name])
            if value.shape != e.shape:
                raise InvalidArgument(f"{e.name}: state has shape {value.shape}, model {e.shape}")
            flat[e.offset : e.offset + e.numel] = value.reshape(-1)
        if unit.strategy.shards_grads:
            lo, hi = unit.layout.shard_range(unit.shard_group.rank)
            unit.shard[:] = flat[lo:hi]
        else:
            unit.shard[:] = flat
        if unit.full is not None and unit.full is not unit.shard:
            np.copyto(unit.full, flat)
