"""What a peer copy holds of a rank's FSDP state, and what it must match to be restored:
the rank's arrays by name, the part of each unit's flat buffer they are, the model and
optimizer they are of."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardwire.worker.fsdp.copyplan import Snapshot, pack
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.wrapper import FSDP


def layout_of(fsdp: FSDP) -> list[tuple[str, np.ndarray]]:
    """What a rank alone holds, by name: each unit's shard, then its optimizer slots."""
    state = fsdp.optimizer.state
    out = []
    for index, unit in enumerate(fsdp.all_units()):
        out.append((f"{index}:param", unit.shard))
        slots = state[index] if index < len(state) else {}
        out += [(f"{index}:{slot}", slots[slot]) for slot in sorted(slots)]
    return out


def held_state(fsdp: FSDP) -> tuple[str, list[np.ndarray]]:
    """What this rank holds (its shards and optimizer slots), with a key that ranks
    holding the same bytes share: every rank under NO_SHARD, the same shard of each
    replica under HYBRID_SHARD (in the same stage and tensor-parallel slice of a mesh).
    A chaos plan's checks compare the digests of the ranks of one key."""
    group = fsdp.shard_group
    key = "whole" if fsdp.strategy is Strategy.NO_SHARD else f"shard {group.rank}/{group.size}"
    if fsdp.mesh is not None:
        c = fsdp.mesh.coords
        key = f"stage {c.stage}, tp {c.shard}: {key}"
    return key, [array for _name, array in layout_of(fsdp)]


# ---- the shell on a group --------------------------------------------------------------


def snapshot(
    fsdp: FSDP,
    step: int,
    rngs: dict[str, str],
    extra: dict[str, Any],
    where: tuple[int, int, int] | None = None,
) -> Snapshot:
    """A snapshot of what this rank of ``fsdp``'s group holds, taken as of ``step``;
    ``where``: its ``(rank, world, family)`` in the copies' group when that is not
    FSDP's own (DiLoCo's replicas: the whole job, one family per replica)."""
    shards, shard = geometry(fsdp)
    rank, world, family = where or (fsdp.group.rank, fsdp.group.size, 0)
    info = {
        "step": step,
        "rank": rank,
        "world": world,
        "family": family,
        "shards": shards,
        "shard": shard,
        "numels": [u.layout.numel for u in fsdp.all_units()],
        "kind": {k: v for k, v in kind(fsdp).items() if k != "slots"},
        "steps": fsdp.optimizer.steps,
        "rngs": rngs,
        "extra": extra,
    }
    return pack(layout_of(fsdp), info)


@dataclass
class Live:
    """What the last save was called with: the model, its step, and the optimizer's step
    count, generators and ``extra`` then."""

    fsdp: FSDP
    step: int
    steps: int
    rngs: dict[str, str]
    extra: dict[str, Any]


def geometry(fsdp: FSDP) -> tuple[int, int]:
    """Which part of each unit's flat buffer this rank holds: ``(shards, shard)``."""
    units = fsdp.all_units()
    if not units or not units[0].strategy.shards_grads:
        return 1, 0
    return units[0].layout.shards, units[0].shard_group.rank


def kind(fsdp: FSDP) -> dict[str, Any]:
    """What a snapshot must match to be restored here: each unit's values and dtype, and
    the optimizer (its slots, once it has any)."""
    units = fsdp.all_units()
    slots = sorted(fsdp.optimizer.state[0]) if fsdp.optimizer.state else None
    return {
        "numels": [u.layout.numel for u in units],
        "dtypes": [u.layout.dtype.str for u in units],
        "optimizer": type(fsdp.optimizer).__name__,
        "slots": slots,
    }


def fits(snap: Snapshot, kind: dict[str, Any]) -> bool:
    """Whether ``snap`` was taken of this model and optimizer (whose slots, once it has
    any, must be the snapshot's)."""
    slots = sorted({n.split(":", 1)[1] for n, _s, _d in snap.meta["layout"]} - {"param"})
    same = all(snap.meta["kind"][k] == kind[k] for k in ("numels", "dtypes", "optimizer"))
    return same and (kind["slots"] is None or kind["slots"] == slots)
