"""Checkpoint tensors across tensor-parallel layouts.

A parameter split over a tensor-parallel group is saved as its slices, one tensor per
slice, ``param:NAME@tpK`` (and ``optim:SLOT:NAME@tpK``) with the slice's shape and how
the parameter is split (:class:`~shardwire.worker.nn.parallel.Partition`). Parameters
every rank of the group holds alike are saved once, from the group's first rank, under
their plain names. A loader whose model is split the same way reads its own slice's
pieces; any other loader (another ``tp``, or none) assembles the whole parameter from the
slices and takes its part, one parameter at a time.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from shardwire.worker.fsdp.store import CheckpointCorrupt, CheckpointError, PieceReader
from shardwire.worker.nn.parallel import Partition

_SLICE = re.compile(r"^(.*)@tp(\d+)$")


def slice_key(base: str, index: int) -> str:
    """The key of slice ``index`` of tensor ``base`` (``param:NAME``)."""
    return f"{base}@tp{index}"


def base_of(key: str) -> str:
    """``param:NAME`` for ``param:NAME@tpK`` (and the key itself otherwise)."""
    found = _SLICE.match(key)
    return found.group(1) if found else key


class Saved:
    """A checkpoint's tensor table (the manifest's ``tensors``), with each split tensor's
    slices found once."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors
        self._slices: dict[str, dict[int, dict[str, Any]]] = {}
        for key, entry in tensors.items():
            found = _SLICE.match(key)
            if found:
                self._slices.setdefault(found.group(1), {})[int(found.group(2))] = entry

    def slices(self, base: str) -> dict[int, dict[str, Any]]:
        """The saved slices of ``base``, by slice index (empty if saved whole)."""
        return self._slices.get(base, {})

    def partition(self, base: str) -> Partition | None:
        """How ``base`` was split when saved (None: saved whole, or not at all)."""
        found = self.slices(base)
        return Partition(**next(iter(found.values()))["partition"]) if found else None

    def shape(self, base: str) -> tuple[tuple[int, ...], str] | None:
        """The whole saved tensor's shape and dtype (None if the checkpoint lacks it)."""
        if base in self.tensors:
            return tuple(self.tensors[base]["shape"]), self.tensors[base]["dtype"]
        found = self.slices(base)
        if not found:
            return None
        entry = next(iter(found.values()))
        return Partition(**entry["partition"]).full_shape(tuple(entry["shape"])), entry["dtype"]

    def whole(self, reader: PieceReader, base: str) -> np.ndarray:
        """The whole saved tensor ``base``, assembled from its slices if it was split."""
        tensors = self.tensors
        if base in tensors:
            entry = tensors[base]
            shape = tuple(entry["shape"])
            return read_range(reader, base, entry, 0, math.prod(shape)).reshape(shape)
        found = self.slices(base)
        if not found:
            raise CheckpointError(f"the checkpoint has no tensor {base!r}")
        first = next(iter(found.values()))
        part = Partition(**first["partition"])
        if sorted(found) != list(range(part.of)):
            raise CheckpointCorrupt(
                f"{base}: slices {sorted(found)} of {part.of} were saved", tensor=base
            )
        full = np.empty(part.full_shape(tuple(first["shape"])), np.dtype(first["dtype"]))
        for index, entry in found.items():
            shape = tuple(entry["shape"])
            key = slice_key(base, index)
            local = read_range(reader, key, entry, 0, math.prod(shape)).reshape(shape)
            at: list[Any] = [slice(None)] * full.ndim
            at[part.axis] = part.indices(index)
            full[tuple(at)] = local
        return full


def read_range(
    reader: PieceReader, key: str, entry: dict[str, Any], start: int, count: int
) -> np.ndarray:
    """Values ``start``..``start + count`` of saved tensor ``key`` (flat, C order)."""
    out = np.empty(count, np.dtype(entry["dtype"]))
    covered = 0
    for piece in entry["pieces"]:
        first = piece["start"]
        a, b = max(start, first), min(start + count, first + piece["count"])
        if a >= b:
            continue
        out[a - start : b - start] = reader.piece(key, piece)[a - first : b - first]
        covered += b - a
    if covered != count:
        raise CheckpointCorrupt(
            f"{key}: the pieces cover {covered} of the {count} values needed here", tensor=key
        )
    return out


class SplitReader:
    """Reads this rank's values of saved tensors, whatever tensor-parallel split they
    were saved with. ``mine``: how this rank's model splits its parameters (by name);
    ``index``: this rank's slice."""

    def __init__(
        self, reader: PieceReader, saved: Saved, mine: dict[str, Partition], index: int
    ) -> None:
        self.reader, self.saved, self.mine, self.index = reader, saved, mine, index

    def values(self, base: str, name: str, start: int, count: int) -> np.ndarray:
        """Values ``start``..``start + count`` of this rank's ``base`` (``param:NAME`` or
        ``optim:SLOT:NAME``; ``name`` is the parameter's)."""
        part, tensors = self.mine.get(name), self.saved.tensors
        if part is None and base in tensors:
            return read_range(self.reader, base, tensors[base], start, count)
        if part is not None and self.saved.partition(base) == part:
            key = slice_key(base, self.index)
            return read_range(self.reader, key, tensors[key], start, count)
        full = self.saved.whole(self.reader, base)
        if part is not None:
            full = np.take(full, part.indices(self.index), axis=part.axis)
        return np.ascontiguousarray(full).reshape(-1)[start : start + count]
