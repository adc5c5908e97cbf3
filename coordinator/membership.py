"""Checks on joiners against the job's shape and the members so far (pure functions).

Each returns ``None`` when the joiner fits, or a ``(code, message)`` refusal that the
rendezvous sends back at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardwire.coordinator.diagnosis import ranks_text
from shardwire.protocol.messages import Join


@dataclass(slots=True)
class Shape:
    world_size: int  # the largest the job may be (every node in)
    local_world_size: int
    min_nodes: int = 0  # 0: exactly nnodes

    def sized(self, world_size: int) -> Shape:
        """This shape for one generation's world size."""
        return Shape(world_size, self.local_world_size, self.min_nodes)

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size


def shape_problem(
    expected: int | None, shape: Shape | None, world_size: int, local_world_size: int
) -> str | None:
    """Does a joiner's (world size, processes per node) agree with the job's?"""
    expected = expected or (shape.world_size if shape else None)
    if expected and world_size != expected:
        return f"world size disagreement: this joiner says {world_size}, the job has {expected}"
    if world_size % local_world_size:
        return f"world size {world_size} is not a multiple of processes per node {local_world_size}"
    if shape and local_world_size != shape.local_world_size:
        return (
            f"processes-per-node disagreement: this joiner says {local_world_size}, "
            f"the job has {shape.local_world_size}"
        )
    return None


class JoinIndex:
    """What the workers joined so far claim, indexed so that checking one more joiner
    costs the same whatever the job's size (a thousand joins, not a million steps)."""

    def __init__(self) -> None:
        self._slots: set[tuple[str, int]] = set()  # (node id, local rank)
        # plain dicts of counts: a Counter costs a few microseconds to make, per joiner
        self._nodes: dict[str, int] = {}  # workers per node id
        self._requested: dict[int, str] = {}  # requested rank -> node id
        self._node_ranks: dict[str, dict[int, int]] = {}  # node id -> requested node ranks
        self._owners: dict[int, dict[str, int]] = {}  # requested node rank -> node ids

    def add(self, j: Join, lws: int) -> None:
        self._slots.add((j.node_id, j.local_rank))
        _count(self._nodes, j.node_id)
        if j.requested_rank is not None:
            r = j.requested_rank
            self._requested[r] = j.node_id
            _count(self._node_ranks.setdefault(j.node_id, {}), r // lws)
            _count(self._owners.setdefault(r // lws, {}), j.node_id)

    def remove(self, j: Join, lws: int) -> None:
        self._slots.discard((j.node_id, j.local_rank))
        self._nodes[j.node_id] -= 1
        if not self._nodes[j.node_id]:
            del self._nodes[j.node_id]
        if j.requested_rank is not None:
            r = j.requested_rank
            self._requested.pop(r, None)
            _drop(self._node_ranks, j.node_id, r // lws)
            _drop(self._owners, r // lws, j.node_id)

    def problem(self, shape: Shape, msg: Join) -> tuple[str, str] | None:
        """Does a worker's node, local rank and requested rank fit those already joined?"""
        lws = shape.local_world_size
        if msg.local_rank >= lws:
            return "bad_request", f"local rank {msg.local_rank} >= processes per node {lws}"
        if (msg.node_id, msg.local_rank) in self._slots:
            return (
                "duplicate_rank",
                f"node {msg.node_id!r} already has local rank {msg.local_rank}",
            )
        if msg.node_id not in self._nodes and len(self._nodes) >= shape.nnodes:
            return "world_size", f"already {len(self._nodes)} nodes, the job has {shape.nnodes}"
        if msg.requested_rank is None:
            return None
        r = msg.requested_rank
        if r >= shape.world_size or r % lws != msg.local_rank:
            return "bad_request", (
                f"requested rank {r} does not fit world size {shape.world_size} "
                f"with local rank {msg.local_rank} of {lws}"
            )
        if r in self._requested:
            node = self._requested[r]
            return "duplicate_rank", f"rank {r} was already requested by node {node!r}"
        if any(n != r // lws for n in self._node_ranks.get(msg.node_id, ())):
            return "bad_request", f"node {msg.node_id!r} requested ranks on two nodes"
        taken = [n for n in self._owners.get(r // lws, ()) if n != msg.node_id]
        if taken:
            return "duplicate_rank", f"node rank {r // lws} is taken by {taken[0]!r}"
        return None


def _count(counts: dict, key: object) -> None:
    counts[key] = counts.get(key, 0) + 1


def _drop(table: dict, key: object, item: object) -> None:
    counts = table.get(key)
    if counts is not None:
        counts[item] -= 1
        if counts[item] <= 0:
            del counts[item]
        if not counts:
            del table[key]


def assign_node_ranks(shape: Shape, joined: Sequence[Join]) -> dict[str, int]:
    """Node id -> node rank: requested ranks fix their node's (where the generation has
    that node rank: after a node's loss, survivors that asked for ranks past the smaller
    world take the free ones); the rest by node id."""
    lws = shape.local_world_size
    fixed: dict[str, int] = {}
    for j in joined:
        if j.requested_rank is not None and j.requested_rank // lws < shape.nnodes:
            fixed[j.node_id] = j.requested_rank // lws
    free = iter(sorted(set(range(shape.nnodes)) - set(fixed.values())))
    nodes = sorted({j.node_id for j in joined} - set(fixed))
    return fixed | {node: next(free) for node in nodes}


def describe_missing(shape: Shape | None, joined: Sequence[Join], *, agents: int) -> str:
    """Who has not joined yet, for join-timeout errors and status."""
    if shape is None:
        return "nobody joined"
    lws, nnodes = shape.local_world_size, shape.nnodes
    workers = bool(joined) or not agents
    count = len(joined) if workers else agents
    unit = "workers" if workers else "node agents"
    total = shape.world_size if workers else nnodes
    requested = {j.requested_rank for j in joined}
    if workers and None not in requested:
        gone = sorted(set(range(shape.world_size)) - requested)
        return f"{count} of {total} {unit} joined; missing {ranks_text(gone)}"  # runs: short
    per_node: dict[str, int] = {}
    for j in joined:
        per_node[j.node_id] = per_node.get(j.node_id, 0) + 1
    nodes = ", ".join(f"{n} {c}/{lws}" for n, c in sorted(per_node.items()))
    return f"{count} of {total} {unit} joined" + (f" (nodes: {nodes})" if nodes else "")
