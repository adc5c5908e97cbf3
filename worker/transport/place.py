"""Where this process sits in the job: its rank, the world, the generation, and the node
of every rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
