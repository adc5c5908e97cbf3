"""The pure core of :class:`~shardwire.torch.peerstorage.PeerStorage`: what one rank's
part of a ``torch.distributed.checkpoint`` holds, how it is written down for the wire,
and which checkpoints the live ranks can still restore.

A *part* is what one rank wrote for one checkpoint: its final save plan's items (DCP's
``WriteItem``: each a tensor chunk or a blob of bytes), the plan's ``planner_data``, and
the items' bytes end to end in one buffer, with the buffer's xxh3 digest. The rank that
wrote it (its *owner*, numbered as in the world that saved) keeps it, and a copy goes to
another rank. DCP's global ``Metadata`` is not kept anywhere: every rank rebuilds it
from the parts' items exactly as DCP's default planner built it at save time, so no
single rank (DCP's coordinator) is needed to load.

A checkpoint is *whole* when the live ranks hold, intact, a part of every owner of the
world that saved it; the newest whole checkpoint is the one to restore. Checkpoints are
ordered by ``seq``: the save's number, one more than the highest any saving rank had
seen.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardwire.protocol.errors import InvalidArgument


@dataclass(frozen=True)
class Where:
    """Where an item's bytes are: in the part of ``owner`` (a rank of the world that
    saved), ``nbytes`` from ``offset``. DCP keeps it as the item's ``storage_data``."""

    owner: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class PartLayout:
    """What one owner wrote, without the bytes: its final plan's items, where each
    item's bytes lie in its part, and the plan's ``planner_data``."""

    owner: int
    items: list[WriteItem]
    places: list[Where]
    planner_data: Any


@dataclass
class Part:
    """One rank's part of one checkpoint: its layout, its bytes end to end (``data``)
    and the digest ``data`` had when it was written."""

    checkpoint: str
    seq: int
    world: int
    layout: PartLayout
    data: np.ndarray
    digest: str

    @property
    def owner(self) -> int:
        return self.layout.owner

    def intact(self) -> bool:
        """Whether ``data`` still has the digest it was written with."""
        return digest(self.data) == self.digest


def digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data).data)


# ---- the wire form of a part's description ---------------------------------------------
# msgpack-able lists of names and numbers; torch's types travel by name and are looked
# up again among torch's own (never unpickled).


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, kind):
        raise InvalidArgument(f"a checkpoint part names {name!r}, which is not a torch {kind}")
    return value


def _size(values: Sequence[int] | None) -> torch.Size | None:
    return None if values is None else torch.Size(values)


def _encode_item(item: WriteItem) -> list[Any]:
    index = item.index
    head = [index.fqn, None if index.offset is None else list(index.offset), index.index]
    if item.type == WriteItemType.BYTE_IO:
        nbytes = item.bytes_io_data.nbytes if item.bytes_io_data is not None else None
        return [*head, item.type.value, nbytes, None]
    data = item.tensor_data
    assert data is not None  # DCP's planner gives every tensor item its chunk
    p = data.properties
    tensor = [
        list(data.chunk.offsets),
        list(data.chunk.sizes),
        str(p.dtype),
        str(p.layout),
        p.requires_grad,
        str(p.memory_format),
        p.pin_memory,
        list(data.size),
    ]
    return [*head, item.type.value, None, tensor]


def _decode_item(raw: Sequence[Any]) -> WriteItem:
    fqn, offset, hint, kind, nbytes, tensor = raw
    index = MetadataIndex(fqn, _size(offset), hint)
    if tensor is None:
        io = None if nbytes is None else BytesIOWriteData(nbytes)
        return WriteItem(index, WriteItemType(kind), bytes_io_data=io)
    offsets, sizes, dtype, layout, grad, fmt, pin, size = tensor
    properties = TensorProperties(
        dtype=_torch_attr(dtype, torch.dtype),
        layout=_torch_attr(layout, torch.layout),
        requires_grad=grad,
        memory_format=_torch_attr(fmt, torch.memory_format),
        pin_memory=pin,
    )
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    data = TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(size))
    return WriteItem(index, WriteItemType(kind), tensor_data=data)


def _plain(value: Any) -> Any:
    """``planner_data`` as msgpack carries it (DCP's default planner: a mapping of flat
    keys to paths of names and list positions)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise InvalidArgument(
        f"PeerStorage keeps the plans of DCP's default planner; this planner's data holds "
        f"a {type(value).__name__}"
    )


def _paths(value: Any) -> Any:
    """The default planner's mapping again, its paths as tuples."""
    if isinstance(value, dict):
        return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return value


def describe(part: Part) -> dict[str, Any]:
    """A part without its bytes, as msgpack carries it."""
    layout = part.layout
    return {
        "checkpoint": part.checkpoint,
        "seq": part.seq,
        "owner": layout.owner,
        "world": part.world,
        "items": [_encode_item(i) for i in layout.items],
        "places": [[w.offset, w.nbytes] for w in layout.places],
        "planner_data": _plain(layout.planner_data),
        "digest": part.digest,
        "nbytes": int(part.data.nbytes),
    }


def layout_of(described: dict[str, Any]) -> PartLayout:
    """The layout a :func:`describe` wrote down."""
    owner = int(described["owner"])
    return PartLayout(
        owner=owner,
        items=[_decode_item(i) for i in described["items"]],
        places=[Where(owner, int(o), int(n)) for o, n in described["places"]],
        planner_data=_paths(described["planner_data"]),
    )


def rebuild(described: dict[str, Any], data: np.ndarray) -> Part:
    """The part :func:`describe` wrote down, with its bytes."""
    if data.nbytes != described["nbytes"]:
        raise InvalidArgument(
            f"part of rank {described['owner']} of checkpoint {described['checkpoint']!r}: "
            f"expected {described['nbytes']} bytes, got {data.nbytes}"
        )
    return Part(
        checkpoint=str(described["checkpoint"]),
        seq=int(described["seq"]),
        world=int(described["world"]),
        layout=layout_of(described),
        data=data,
        digest=str(described["digest"]),
    )


def encode_plan(plan: SavePlan) -> list[Any]:
    """A rank's local save plan as msgpack carries it: its items and ``planner_data``."""
    return [[_encode_item(i) for i in plan.items], _plain(plan.planner_data)]


def decode_plan(raw: Sequence[Any]) -> SavePlan:
    """The plan :func:`encode_plan` wrote down."""
    items, planner_data = raw
    return SavePlan(items=[_decode_item(i) for i in items], planner_data=_paths(planner_data))


# ---- planning a save --------------------------------------------------------------------


def final_plans(local: Sequence[SavePlan], *, to_lowest_rank: bool = False) -> list[SavePlan]:
    """Every rank's final plan from every rank's local plan (in rank order), as DCP's
    default planner makes them on its coordinator: an item several ranks hold (a
    replicated tensor) is written by one of them (the one with the least planned so
    far, or the lowest rank), and index hints are rewritten. Every rank computes the
    same plans from the same local plans, so no rank has to plan for the others."""
    deduped = dedup_save_plans(list(local), to_lowest_rank)
    plans, _ = create_default_global_save_plan(deduped)
    return plans


# ---- metadata ---------------------------------------------------------------------------


def metadata(layouts: Sequence[PartLayout]) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint from every owner's layout (any order), as DCP's
    default planner made it when the checkpoint was saved."""
    ordered = sorted(layouts, key=lambda p: p.owner)
    plans = [SavePlan(items=p.items, planner_data=p.planner_data) for p in ordered]
    _, md = create_default_global_save_plan(plans, rewrite_index_hints=False)
    mappings = [p.planner_data for p in ordered if isinstance(p.planner_data, dict)]
    if mappings:
        md = dataclasses.replace(md, planner_data=dict(ChainMap(*mappings)))
    md.storage_data = {
        item.index: where for p in ordered for item, where in zip(p.items, p.places, strict=True)
    }
    return md


# ---- what the live ranks hold -----------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """A part some live rank (``server``, in the current group) holds intact."""

    checkpoint: str
    seq: int
    owner: int
    world: int
    server: int


def holdings(parts: Iterable[Part]) -> list[list[Any]]:
    """What this rank holds intact, as msgpack carries it: ``[checkpoint, seq, owner,
    world]`` per part (a damaged part is left out)."""
    return [[p.checkpoint, p.seq, p.owner, p.world] for p in parts if p.intact()]


def gathered(per_rank: Sequence[Sequence[Sequence[Any]]]) -> list[Held]:
    """Every rank's :func:`holdings`, in group rank order, as :class:`Held` records."""
    return [
        Held(str(c), int(s), int(o), int(w), server)
        for server, held in enumerate(per_rank)
        for c, s, o, w in held
    ]


def whole(held: Sequence[Held]) -> list[str]:
    """The checkpoints of which every owner's part is held, newest first."""
    owners: dict[tuple[str, int, int], set[int]] = {}
    for h in held:
        owners.setdefault((h.checkpoint, h.seq, h.world), set()).add(h.owner)
    done = [(seq, c) for (c, seq, world), o in owners.items() if o >= set(range(world))]
    return [c for _, c in sorted(done, reverse=True)]


def missing(held: Sequence[Held], checkpoint: str) -> list[int]:
    """The owners of ``checkpoint`` whose part no live rank holds intact."""
    mine = [h for h in held if h.checkpoint == checkpoint]
    if not mine:
        return []
    world = max(h.world for h in mine)
    return sorted(set(range(world)) - {h.owner for h in mine})


def servers(held: Sequence[Held], checkpoint: str, me: int) -> dict[int, int]:
    """For each owner of ``checkpoint``, the rank that serves its part: this rank where
    it holds it, else the lowest rank that does (every rank computes the same table for
    the others, since each prefers itself only for itself)."""
    table: dict[int, int] = {}
    for h in sorted((h for h in held if h.checkpoint == checkpoint), key=lambda h: h.server):
        if h.server == me or h.owner not in table:
            table[h.owner] = h.server
    return table


def assigned(held: Sequence[Held], checkpoint: str) -> dict[int, int]:
    """For each owner of ``checkpoint``, the one rank that sends its description to all:
    the lowest rank that holds it."""
    table: dict[int, int] = {}
    for h in sorted((h for h in held if h.checkpoint == checkpoint), key=lambda h: h.server):
        table.setdefault(h.owner, h.server)
    return table
