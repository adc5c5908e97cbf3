"""FSDP's share of the model's gradient norm, whatever else the model is split by.

Each rank sums the squares of its gradient shards, separately for the parameters a
tensor-parallel layer splits (``PARTITIONED`` in ``nn.parallel``) and for the others,
entry by entry of each unit's flat layout; the sums are completed over the shard group
(shards are disjoint there, and copies across HYBRID_SHARD's replicas) and then over
tensor and pipeline parallelism (:func:`~shardwire.worker.parallelism.global_norm`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.nn.parallel import partitioned
from shardwire.worker.parallelism import clip_scale, global_norm

if TYPE_CHECKING:
    from shardwire.worker.fsdp.wrapper import FSDP


async def clip_grad_norm(fsdp: FSDP, max_norm: float) -> float:
    """Scale ``fsdp``'s gradients so the model's L2 norm is at most ``max_norm``; returns
    the norm before clipping."""
    split, tp = partitioned(fsdp.model)
    sums = np.zeros(2)  # replicated, partitioned
    for unit in fsdp.all_units():
        grad = unit.grad_shard
        no_shard = fsdp.strategy is Strategy.NO_SHARD
        lo = 0 if no_shard else unit.layout.shard_range(unit.shard_group.rank)[0]
        for entry in unit.layout.entries:
            a, b = max(lo, entry.offset), min(lo + grad.size, entry.offset + entry.numel)
            if a < b:
                piece = grad[a - lo : b - lo]
                sums[1 if entry.name in split else 0] += float(np.dot(piece, piece))
        unit.page_out()
    if fsdp.strategy is not Strategy.NO_SHARD:
        sums = await fsdp.shard_group.all_reduce(sums)
    mesh = fsdp.mesh
    if mesh is not None:
        tp = mesh.tp
    norm = await global_norm(
        float(sums[0]), float(sums[1]), tp=tp, pp=None if mesh is None else mesh.pp
    )
    scale = clip_scale(norm, max_norm)
    if scale is not None:
        for unit in fsdp.all_units():
            unit.grad_shard *= scale
            unit.page_out()
    return norm
