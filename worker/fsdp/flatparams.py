"""Flat parameter layout of one FSDP unit (pure arithmetic and numpy views).

A unit's parameters are laid end to end in a fixed order in one 1-D buffer, padded so
it splits into ``shards`` equal pieces: shard k is ``[k * shard_numel, (k + 1) *
shard_numel)``. The true shapes are kept so the buffer can be viewed as the parameters
again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardwire.protocol.errors import InvalidType
from shardwire.worker.nn.module import Module


@dataclass(frozen=True, slots=True)
class FlatEntry:
    """One parameter: where it lives in the module tree and in the flat buffer."""

    name: str  # dotted name from the model root
    owner: Module  # the module whose ``params`` dict holds it
    local: str  # its key in ``owner.params``
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatLayout:
    entries: tuple[FlatEntry, ...]
    numel: int
    shards: int
    dtype: np.dtype

    @classmethod
    def build(cls, owned: list[tuple[str, Module, str]], shards: int) -> FlatLayout:
        entries, offset = [], 0
        dtype = None
        for name, owner, local in owned:
            value = owner.params[local]
            dtype = dtype or value.dtype
            if value.dtype != dtype:
                raise InvalidType(f"{name} is {value.dtype}, the unit's others are {dtype}")
            entries.append(FlatEntry(name, owner, local, offset, tuple(value.shape)))
            offset += value.size
        return cls(tuple(entries), offset, shards, np.dtype(dtype or np.float64))

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.shards)  # ceil: any group size works

    @property
    def padded(self) -> int:
        return self.shard_numel * self.shards

    def shard_range(self, k: int) -> tuple[int, int]:
        return k * self.shard_numel, (k + 1) * self.shard_numel

    def flatten(self) -> np.ndarray:
        """The parameters as they are now in their modules, copied into a padded buffer."""
        flat = np.zeros(self.padded, self.dtype)
        for e in self.entries:
            flat[e.offset : e.offset + e.numel] = e.owner.params[e.local].reshape(-1)
        return flat

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        return [flat[e.offset : e.offset + e.numel].reshape(e.shape) for e in self.entries]

    def bind_params(self, flat: np.ndarray) -> None:
        for e, view in zip(self.entries, self.views(flat), strict=True):
            e.owner.params[e.local] = view

    def bind_grads(self, flat: np.ndarray) -> None:
        for e, view in zip(self.entries, self.views(flat), strict=True):
            e.owner.grads[e.local] = view

    def release_params(self) -> None:
        """Drop the modules' references, so a gathered buffer can really be freed."""
        for e in self.entries:
            e.owner.params[e.local] = _FREED

    def release_grads(self) -> None:
        for e in self.entries:
            e.owner.grads[e.local] = _FREED


_FREED = np.zeros(0)
_FREED.flags.writeable = False
