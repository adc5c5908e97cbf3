"""Which backend a group's calls run on, chosen once from the roster (the node of every
rank), and what a group may ask for instead.

* links: a group of one rank per node, a group whose nodes are not known (yet), or a
  node whose groups may not use an arena;
* arena: every rank of the group on this node, the node allowing arenas;
* tiered: ranks on several nodes, two or more on one of them: lanes when every node
  holds the same number of ranks (``backends.tiered``), leaders otherwise
  (``backends.leaders``).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.backends.algorithms import CHOICES, Algorithm
from shardwire.worker.backends.arena import ArenaBackend
from shardwire.worker.backends.base import Backend
from shardwire.worker.backends.leaders import Leaders
from shardwire.worker.backends.peerlinks import LinksBackend
from shardwire.worker.backends.tiered import Lanes
from shardwire.worker.kernels.segments import node_layout
from shardwire.worker.transport.base import Transport

if TYPE_CHECKING:
    from shardwire.worker.collectives.group import Group

DEFAULT_TIMEOUT = 300.0
BACKENDS = ("links", "arena", "tiered")


def group_id_for(ranks: Sequence[int], name: str = "") -> int:
    """A group id every member derives alike from the member list (0 is the world)."""
    text = f"{name}|{','.join(map(str, ranks))}"
    return (zlib.crc32(text.encode()) & 0x3FFFFFFF) + 1


def members(transport: Transport, ranks: Sequence[int] | None, group_id: int) -> tuple[int, ...]:
    """A new group's members (global ranks; None: the world), checked: distinct, this
    rank among them, the group id free on this transport."""
    chosen = tuple(range(transport.world_size)) if ranks is None else tuple(ranks)
    if len(set(chosen)) != len(chosen) or not chosen:
        raise InvalidArgument(f"group ranks must be distinct and non-empty, got {list(chosen)}")
    if transport.rank not in chosen:
        raise InvalidArgument(f"rank {transport.rank} is not a member of group {list(chosen)}")
    live = transport.groups.get(group_id)
    if live is not None:
        raise InvalidArgument(
            f"group id {group_id} is already used on rank {transport.rank} by group "
            f"{list(live.ranks)}; close that group first"
        )
    return chosen


def open_group(
    transport: Transport, ranks: list[int], name: str, kind: type[Group]
) -> tuple[int, Group | None]:
    """(the id of the subgroup of ``ranks`` named ``name``, that group if it is open: a
    ``kind`` of the same members, else an error)."""
    group_id = group_id_for(ranks, name)
    live = transport.groups.get(group_id)
    if live is None:
        return group_id, None
    if not isinstance(live, kind) or list(live.ranks) != ranks:
        raise InvalidArgument(
            f"group id {group_id} of ranks {ranks} (name {name!r}) collides "
            f"with open group {list(live.ranks)}; use another name"
        )
    return group_id, live


@dataclass(frozen=True, slots=True)
class Choice:
    """A group's own asks: a backend (None: from the roster) and algorithms pinned per
    op on links. ``marks`` is what each op adds to its calls' signatures, so members
    that asked differently fail as a mismatch, not a hang."""

    backend: str | None = None
    algorithms: Mapping[str, Algorithm] = field(default_factory=dict)
    marks: Mapping[str, str] = field(default_factory=dict)
    every: str = ""  # the mark of every op (a backend asked for)

    @classmethod
    def of(cls, backend: str | None, algorithms: Mapping[str, str] | None) -> Choice:
        if backend is not None and backend not in BACKENDS:
            raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        pinned: dict[str, Algorithm] = {}
        for op, name in (algorithms or {}).items():
            allowed = CHOICES.get(op)
            if allowed is None:
                raise InvalidArgument(
                    f"algorithms: {op!r} has no algorithm to pin; ops: {', '.join(CHOICES)}"
                )
            if name not in allowed:
                names = ", ".join(sorted(allowed))
                raise InvalidArgument(f"algorithms: {op} runs by one of {names}, not {name!r}")
            pinned[op] = Algorithm(name)
        if backend is None and not pinned:
            return _DEFAULT
        marks = {op: f"@{how}" for op, how in pinned.items()}
        return cls(backend, pinned, marks, f"@{backend}" if backend else "")

    @property
    def asked(self) -> bool:
        """Whether the group asked for anything (else its signatures carry no marks)."""
        return self is not _DEFAULT

    def mark(self, kind: str) -> str:
        """What a call of ``kind`` adds to its signature."""
        return self.every + self.marks.get(kind, "")


_DEFAULT = Choice()


def backend_for(group: Group) -> tuple[Backend, bool]:
    """(the backend of ``group``, whether the roster was known to choose it)."""
    transport, choice = group.transport, group.choice
    topology = transport.topology
    links = LinksBackend(group.size, topology, choice.algorithms)
    nodes, wanted = topology.nodes, choice.backend
    if wanted == "links" or group.size == 1:
        return links, True
    if nodes is None:
        if wanted is not None:
            raise InvalidArgument(f"backend {wanted!r} needs the node of every rank (a roster)")
        return links, False
    mine = nodes[transport.rank]
    here = all(nodes[r] == mine for r in group.ranks)
    settings = topology.arena
    if wanted == "arena" or (wanted is None and here and settings is not None):
        if not here or settings is None:
            raise InvalidArgument(
                f"backend 'arena' needs every rank of group {group.group_id} on this node "
                "and a node that allows arenas"
            )
        what = f"rank {transport.rank}, group {group.group_id}"
        return ArenaBackend(links, settings, group.spawn, what, transport.stats), True
    layout = node_layout([nodes[r] for r in group.ranks])
    if wanted == "tiered" or (wanted is None and layout is not None):
        if layout is None:
            raise InvalidArgument(
                f"backend 'tiered' needs group {group.group_id} on several nodes, two or "
                "more ranks on one of them"
            )
        even = len({len(ranks) for ranks in layout}) == 1
        kind = Lanes if even else Leaders

        def new_group(ranks: list[int], name: str) -> Group:
            return group.new_group(ranks, name=name)

        tiered = kind(
            links,
            layout,
            rank=group.rank,
            new_group=new_group,
            group_id=group.group_id,
            on_failure=group.fail,
        )
        return tiered, True
    return links, True
