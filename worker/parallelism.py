"""A group's ranks laid out as data x pipeline x tensor parallelism, built once.

Theory of operation
-------------------
The ranks of a group of ``dp * pp * tp`` are numbered tensor-parallel index fastest, then
data-parallel, then pipeline stage (Megatron's order)::

    rank = (stage * dp + replica) * tp + shard

so a tensor-parallel group is ``tp`` consecutive ranks. Launchers give consecutive ranks
to one node, so tensor parallelism, which talks at every layer, stays inside a node; the
mesh refuses a layout whose tensor-parallel groups would cross nodes. Each rank belongs
to one group of each kind, made here once (as subgroups of the group, named, so making
the same mesh again returns the same groups):

* ``tp``: the ranks holding the other slices of this rank's layers;
* ``dp``: the ranks holding the same slices of the same stage (FSDP shards over it, or
  plain data parallelism averages over it);
* ``pp``: one rank of every stage, with this rank's replica and slice index.

Gradient clipping needs one norm over the whole model, whatever the layout
(:meth:`Mesh.total_norm`): parameters split over ``tp`` are summed over it, parameters
every tensor-parallel rank holds alike are counted once, and the stages' sums are added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardwire.protocol import ShardwireError
from shardwire.worker.collectives import Group


class MeshError(ShardwireError, ValueError):
    """A layout that does not fit the group (sizes, or nodes)."""


@dataclass(frozen=True)
class Coords:
    """Where a rank sits in the mesh."""

    stage: int  # pipeline stage, 0 .. pp-1
    replica: int  # data-parallel index, 0 .. dp-1
    shard: int  # tensor-parallel index, 0 .. tp-1


class Mesh:
    """``group``'s ranks as ``dp`` x ``pp`` x ``tp`` (see the module docstring).

    Attributes:
        dp, pp, tp: the groups of this rank (a group of one where that size is 1).
        sizes: (dp, pp, tp).
        coords: this rank's :class:`Coords`.
    """

    def __init__(self, group: Group, *, dp: int | None = None, pp: int = 1, tp: int = 1):
        if pp < 1 or tp < 1 or (dp is not None and dp < 1):
            raise MeshError(f"mesh sizes must be at least 1, got dp={dp} pp={pp} tp={tp}")
        if group.size % (pp * tp):
            raise MeshError(f"{group.size} ranks do not split into pp={pp} x tp={tp}")
        dp = group.size // (pp * tp) if dp is None else dp
        if dp * pp * tp != group.size:
            raise MeshError(
                f"dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but the group has "
                f"{group.size}"
            )
        _check_nodes(group, tp)
        self.group = group
        self.sizes = (dp, pp, tp)
        stage, rest = divmod(group.rank, dp * tp)
        replica, shard = divmod(rest, tp)
        self.coords = Coords(stage, replica, shard)

        def rank(s: int, r: int, t: int) -> int:
            return (s * dp + r) * tp + t

        self.tp = group.new_group([rank(stage, replica, t) for t in range(tp)], name="mesh-tp")
        self.dp = group.new_group([rank(stage, r, shard) for r in range(dp)], name="mesh-dp")
        self.pp = group.new_group([rank(s, replica, shard) for s in range(pp)], name="mesh-pp")

    def __repr__(self) -> str:
        (dp, pp, tp), c = self.sizes, self.coords
        where = f"stage {c.stage}, replica {c.replica}, shard {c.shard}"
        return f"Mesh(dp={dp}, pp={pp}, tp={tp}; {where})"

    async def total_norm(self, replicated_sq: float, partitioned_sq: float) -> float:
        """The model's gradient L2 norm (see :func:`global_norm`) over this mesh."""
        return await global_norm(replicated_sq, partitioned_sq, tp=self.tp, pp=self.pp)


async def global_norm(
    replicated_sq: float, partitioned_sq: float, *, tp: Group | None, pp: Group | None
) -> float:
    """The model's gradient L2 norm from this rank's sums of squares, each already
    complete over the data-parallel ranks (FSDP sums its shards; plain data parallelism
    holds copies): ``partitioned_sq`` over the parameters split across ``tp``,
    ``replicated_sq`` over those every rank of ``tp`` holds alike; the stages of ``pp``
    hold disjoint parameters."""
    if tp is not None and tp.size > 1:
        partitioned_sq = float((await tp.all_reduce(np.array([partitioned_sq])))[0])
    total = replicated_sq + partitioned_sq
    if pp is not None and pp.size > 1:
        total = float((await pp.all_reduce(np.array([total])))[0])
    return math.sqrt(total)


def clip_scale(norm: float, max_norm: float) -> float | None:
    """What gradients of L2 norm ``norm`` are multiplied by to clip them at ``max_norm``
    (None: they are within it)."""
    return max_norm / (norm + 1e-6) if norm > max_norm else None


def _check_nodes(group: Group, tp: int) -> None:
    """Refuse tensor-parallel groups that would cross nodes (when the nodes are known)."""
    nodes = group.transport.topology.nodes
    if nodes is None or tp == 1:
        return
    for start in range(0, group.size, tp):
        members = group.ranks[start : start + tp]
        if len({nodes[r] for r in members}) > 1:
            raise MeshError(
                f"tensor-parallel group of ranks {list(members)} would span nodes "
                f"{sorted({str(nodes[r]) for r in members})}: make tp divide the ranks "
                "per node (tensor parallelism talks at every layer)"
            )
