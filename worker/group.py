"""The process-group handle a worker script holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwire.protocol.messages import Member
from shardwire.worker.transport.base import Transport


@dataclass
class ProcessGroup:
    """This process's place in the job, and the transport to its peers.

    Attributes:
        rank: global rank, 0 ... world_size-1.
        world_size: number of worker processes.
        local_rank: index on this node; local_world_size: processes per node.
        node_rank: index of this node (ranks node_rank*L ... node_rank*L+L-1 live on it).
        generation: rendezvous generation; every data frame carries it.
        members: the roster (rank, node, address) of every process.
        transport: point-to-point messaging to the other ranks.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    generation: int
    transport: Transport
    members: list[Member] = field(default_factory=list)

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_ranks(self, node_rank: int | None = None) -> list[int]:
        """Global ranks on ``node_rank`` (default: this node)."""
        node = self.node_rank if node_rank is None else node_rank
        start = node * self.local_world_size
        return list(range(start, start + self.local_world_size))
