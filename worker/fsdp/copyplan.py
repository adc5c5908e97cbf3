"""The pure core of peer copies: where each rank's copy lives, what a snapshot holds,
and which copies each rank of a re-formed group restores its part from.

A snapshot is one rank's state at a step: for every FSDP unit, its part of the unit's
flat buffer (the parameters, then each optimizer slot), with the geometry that says
which part that is (``shards`` pieces, this one ``shard``; the whole buffer is one
piece of one). Any rank of a group of another size or strategy finds the values of its
own part in the snapshots whose parts overlap it, exactly as a disk checkpoint is read
at any world size, so a re-formed group restores in memory whether it kept its ranks,
lost some (a shrink) or gained some.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

# ---- placement -----------------------------------------------------------------------


def holder(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank that holds ``rank``'s copy: the same local rank on the next node, or on
    a single node the next rank."""
    stride = ranks_per_node if world > ranks_per_node else 1
    return (rank + stride) % world


def source(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank whose copy ``rank`` holds (the inverse of :func:`holder`)."""
    stride = ranks_per_node if world > ranks_per_node else 1
    return (rank - stride) % world


# ---- geometry ------------------------------------------------------------------------


def span(numel: int, shards: int, shard: int) -> tuple[int, int]:
    """The values ``[lo, hi)`` of a unit's ``numel`` that piece ``shard`` of ``shards``
    holds (the flat layout's ceil split; padding beyond ``numel`` holds no values)."""
    size = -(-numel // shards)
    lo = min(shard * size, numel)
    return lo, min(lo + size, numel)


@dataclass(frozen=True)
class Have:
    """A snapshot some rank can serve: of which old rank, in a group of ``world``, with
    the part ``shard`` of ``shards`` of every unit, a digest of its random generators'
    states (``streams``), and its ``family``: the replica (DiLoCo's) whose values it
    holds; only a rank of the same family restores from it (0: every rank's the same
    model, as in plain data parallelism)."""

    rank: int
    world: int
    shards: int
    shard: int
    streams: str
    family: int = 0


@dataclass(frozen=True)
class Source:
    """Where one rank of the new group restores from: ``(server, old rank)`` pairs of the
    snapshots it reads its part from, and the old rank whose generators and data
    position it takes (``meta``; its snapshot is among the pairs)."""

    pairs: list[tuple[int, int]]
    meta: int


def _covered(spans: Sequence[tuple[int, int]], numel: int) -> bool:
    at = 0
    for lo, hi in sorted(spans):
        if lo > at:
            return False
        at = max(at, hi)
    return at >= numel


def sources(
    have: Sequence[Sequence[Have]],
    want: Sequence[tuple[int, int]],
    numels: Sequence[int],
    families: Sequence[int] | None = None,
) -> list[Source] | None:
    """Where every rank ``r`` of the new group (``want[r]``: its ``(shards, shard)``;
    ``families[r]``: its replica, default 0; ``have[r]``: the snapshots of one step it
    holds) restores from: each part it needs, from snapshots of its own family, from
    itself when it holds one, and the generators of its own old rank. None when the step
    cannot be restored: some values of a family wanted are held nowhere, or a rank's own
    snapshot is gone and the others' generators differ (a replica's part then serves, but
    not its streams). A rank the old group did not have takes the step's meta from a
    snapshot it reads (it keeps its own generators, as when loading a checkpoint)."""
    family = list(families) if families is not None else [0] * len(want)
    where: dict[int, list[int]] = {}
    snaps: dict[int, Have] = {}
    worlds = {h.world for held in have for h in held}
    if len(worlds) != 1:
        return None
    (world,) = worlds
    for server, held in enumerate(have):
        for h in held:
            where.setdefault(h.rank, []).append(server)
            snaps[h.rank] = h
    by_part: dict[tuple[int, int, int], list[int]] = {}
    for old in sorted(snaps):
        h = snaps[old]
        by_part.setdefault((h.family, h.shards, h.shard), []).append(old)
    for fam in set(family):
        parts = [[span(n, *part[1:]) for n in numels] for part in by_part if part[0] == fam]
        if not all(_covered([p[u] for p in parts], n) for u, n in enumerate(numels)):
            return None
    same_streams = len({h.streams for h in snaps.values()}) == 1
    plan = []
    for r, (shards, shard) in enumerate(want):
        own = r in snaps and snaps[r].family == family[r]
        if r < world and not own and not same_streams:
            return None
        need = [span(n, shards, shard) for n in numels]
        chosen: dict[int, int] = {}  # old rank -> server
        if own:  # its own old rank's: its generators (and, mostly, its part)
            chosen[r] = r if r in where[r] else where[r][0]
        for part, olds in by_part.items():
            if part[0] != family[r]:
                continue
            spans = [span(n, *part[1:]) for n in numels]
            if not any(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(spans, need, strict=True)):
                continue
            if any(o in chosen for o in olds):
                continue
            local = [o for o in olds if r in where[o]]
            old = local[0] if local else olds[0]
            chosen[old] = r if r in where[old] else where[old][0]
        kin = [o for o in snaps if snaps[o].family == family[r]]
        if not own and not (chosen or kin):
            return None
        first = r if own else min(chosen or kin)  # streams all alike (checked)
        chosen.setdefault(first, r if r in where[first] else where[first][0])
        plan.append(Source(sorted((server, old) for old, server in chosen.items()), first))
    return plan


# ---- snapshots -----------------------------------------------------------------------


def digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data).data)


@dataclass
class Snapshot:
    """One rank's state at a step: its arrays' bytes end to end, and what they are."""

    meta: dict[str, Any]  # step, rank, world, geometry, layout, optimizer, rngs, extra, digest
    data: np.ndarray  # uint8

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @functools.cached_property
    def have(self) -> Have:
        m = self.meta
        streams = xxhash.xxh3_64_hexdigest(json.dumps(m["rngs"], sort_keys=True).encode())
        return Have(
            int(m["rank"]),
            int(m["world"]),
            int(m["shards"]),
            int(m["shard"]),
            streams,
            int(m.get("family", 0)),
        )

    def intact(self) -> bool:
        return digest(self.data) == self.meta["digest"]

    def views(self) -> Iterator[tuple[str, np.ndarray]]:
        """Each array by name, a view of the snapshot's bytes (read only)."""
        at = 0
        for name, shape, dtype in self.meta["layout"]:
            kind = np.dtype(dtype)
            size = int(np.prod(shape)) * kind.itemsize
            view = self.data[at : at + size].view(kind).reshape(shape)
            view.flags.writeable = False
            yield name, view
            at += size

    def arrays(self) -> list[np.ndarray]:
        """Copies of the arrays, in layout order (the snapshot stays as it is)."""
        return [view.copy() for _name, view in self.views()]


def _end_to_end(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' bytes end to end, in one new buffer."""
    data = np.empty(sum(a.nbytes for a in arrays), np.uint8)
    at = 0
    for array in arrays:
        data[at : at + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        at += array.nbytes
    return data


def pack(arrays: Sequence[tuple[str, np.ndarray]], info: dict[str, Any]) -> Snapshot:
    """A snapshot of named ``arrays`` (copied) with ``info`` (step, rank, ...)."""
    data = _end_to_end([a for _name, a in arrays])
    layout = [[name, list(a.shape), a.dtype.str] for name, a in arrays]
    return Snapshot({**info, "layout": layout, "digest": digest(data)}, data)


Piece = tuple[str, int, np.ndarray]  # array name ("UNIT:param", "UNIT:SLOT"), first value, values


def cut(snap: Snapshot, shards: int, shard: int) -> list[Piece]:
    """The values of ``snap`` that part ``shard`` of ``shards`` holds, by array, each with
    the position of its first value in its unit's flat buffer."""
    numels, m = snap.meta["numels"], snap.meta
    out = []
    for name, view in snap.views():
        unit = int(name.split(":", 1)[0])
        base = span(numels[unit], int(m["shards"]), int(m["shard"]))[0]
        lo, hi = span(numels[unit], shards, shard)
        a, b = max(lo, base), min(hi, base + view.size)
        if a < b:
            out.append((name, a, view.reshape(-1)[a - base : b - base]))
    return out


def place(pieces: Sequence[Piece], targets: dict[str, np.ndarray], bases: Sequence[int]) -> int:
    """Write each piece into its array's target (whose first value is at ``bases[unit]``
    of the unit's flat buffer); returns how many values were written."""
    written = 0
    for name, first, values in pieces:
        at = first - bases[int(name.split(":", 1)[0])]
        targets[name][at : at + values.size] = values
        written += values.size
    return written


def pieces_bytes(pieces: Sequence[Piece]) -> tuple[list[list[Any]], np.ndarray]:
    """A message's table (name, first value, count, dtype) and its bytes end to end."""
    table = [[name, first, int(v.size), v.dtype.str] for name, first, v in pieces]
    return table, _end_to_end([v for _n, _f, v in pieces])


def bytes_pieces(table: Sequence[Sequence[Any]], data: np.ndarray) -> list[Piece]:
    """The inverse of :func:`pieces_bytes` (views of ``data``)."""
    out, at = [], 0
    for name, first, count, dtype in table:
        kind = np.dtype(dtype)
        out.append((str(name), int(first), data[at : at + count * kind.itemsize].view(kind)))
        at += count * kind.itemsize
    return out
