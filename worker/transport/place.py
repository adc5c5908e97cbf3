"""Where this process sits in the job: its rank, the world, the generation, the node of
every rank, and what follows from those for collectives (:class:`Topology`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwire.worker.transport.arena_settings import ArenaSettings


class NodeMap(Sequence[int]):
    """The node of each rank where ranks are contiguous per node (as the coordinator
    places them): ``per_node`` ranks on each, computed, not listed."""

    __slots__ = ("per_node", "world_size")

    def __init__(self, per_node: int, world_size: int):
        self.per_node, self.world_size = per_node, world_size

    def __getitem__(self, rank):
        if isinstance(rank, slice) or not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is not in a world of {self.world_size}")
        return rank // self.per_node

    def __len__(self) -> int:
        return self.world_size


@dataclass(frozen=True, slots=True)
class Place:
    """Where a process sits in the job, as its placement says."""

    rank: int
    world_size: int
    generation: int = 0


@dataclass(slots=True)
class Topology:
    """What a transport learned of the job's layout from its placement, for the groups
    that run over it (all unknown until then, and for the in-memory transport).

    Attributes:
        nodes: the node of every rank, by rank (None: one node, as far as known).
        crowded: this node runs more ranks than it has CPUs; algorithms that need every
            rank running at once lose there.
        arena: groups whose ranks share this node run their collectives through a node
            arena with these settings (an ``ArenaSettings``), or never (None).
        network: some of the job's links cross a network (not every rank is on this
            machine); false for a job on one machine and the in-memory transport.
    """

    nodes: Sequence[Hashable] | None = None
    crowded: bool = False
    arena: ArenaSettings | None = None
    network: bool = False
