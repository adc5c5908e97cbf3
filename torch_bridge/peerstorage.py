"""``torch.distributed.checkpoint`` storage in the ranks' memory: :class:`PeerStorage`.

A script keeps its DCP code and changes the storage argument::

    store = shardwire.torch.PeerStorage()        # once per process, before training
    ...
    dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=store)
    ...
    newest = store.latest()                      # after a re-formation: agreed by all
    if newest is not None:
        dcp.load(state, checkpoint_id=newest, storage_reader=store)

DCP's planner decides what each rank writes and reads (sharding and resharding: a
checkpoint saved by 4 ranks loads on 3 or on 6); PeerStorage holds the bytes. A save is
planned by the ranks together, not by DCP's coordinator: each keeps its local plan and
hands DCP an empty one, and the ranks exchange their local plans once per state-dict
structure and each computes every rank's final plan as DCP's default planner would
(which rank writes a replicated tensor). A save of an unchanged structure then costs
DCP's small exchanges, one agreement and the copy (``dcp.save`` returns metadata
without items: PeerStorage rebuilds the metadata when it loads). On save,
every rank keeps its part in memory and sends a copy to its *holder* (the same local
rank on the next node; on one node, the next rank), so losing a rank, or a whole node,
leaves every part somewhere. The newest ``keep`` checkpoints are kept (memory: about
``2 * keep`` times a rank's share of the state).

On load every rank rebuilds DCP's metadata from the parts' layouts (no rank is special)
and fetches the bytes it needs from the ranks that hold them, in two all-to-alls (what
each wants, then the bytes). Parts carry xxh3 digests: one that no longer matches is not
offered, so :meth:`PeerStorage.latest` names the newest checkpoint whose every part is
held intact by a live rank. Loading one that is not whole fails typed
(``CheckpointUnavailable``, inside DCP's ``CheckpointException`` on every rank), naming
the parts no live rank holds.

SIGTERM, under live recovery, can be a notice to leave rather than an end: give
``PeerStorage(leave=shardwire.torch.leave_notice())``, and ask :meth:`PeerStorage.leaving`
(a small all-reduce) where the script could save. When any rank was told to leave, every
rank saves at once and calls :meth:`PeerStorage.leave`: the ranks told to leave end with
``LeftJob`` once every part is at its holder, and the others go on; after the
re-formation everyone loads that checkpoint, so no completed step is lost::

    if (step + 1) % every == 0 or store.leaving():
        dcp.save(state, checkpoint_id=f"step-{step + 1}", storage_writer=store)
        store.leave()

Every method DCP calls runs its exchanges on shardwire's loop over a group of its own
beside the default group, so a script's own point-to-point tags never meet them. The
store outlives re-formations in its process (``shardwire.torch.recovering``): it finds
the current default group at every call.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from shardwire.protocol.errors import (
    CheckpointUnavailable,
    InvalidArgument,
    InvalidState,
    LeftJob,
)
from shardwire.torch import peerparts as pp
from shardwire.torch.group import ShardwireProcessGroup, bridged
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp.copyplan import holder, source
from shardwire.worker.runtime.leave import LeaveNotice

log = logging.getLogger(__name__)

_DATA, _DESCRIPTION = 1, 2  # the copy's two messages


class PeerStorage(StorageWriter, StorageReader):
    """A DCP storage writer and reader that keeps checkpoints in the ranks' memory.

    Args:
        group: the torch process group of the shardwire backend the parts move in
            (None: the default group, found again at every call).
        keep: how many of the newest checkpoints each rank keeps (its own parts and the
            copies it holds).
        ranks_per_node: ranks on each node, which places every copy on another node
            (None: what the launcher said, or 1 outside a shardwire job).
        timeout: seconds each exchange may take.
        leave: a notice to leave (``shardwire.torch.leave_notice()``): SIGTERM asks the
            rank to hand its part over (:meth:`leaving`, :meth:`leave`). Every rank
            gives one, or none does.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        keep: int = 2,
        ranks_per_node: int | None = None,
        timeout: float = 300.0,
        leave: LeaveNotice | None = None,
    ) -> None:
        if keep < 1:
            raise InvalidArgument(f"PeerStorage keeps at least 1 checkpoint, got keep={keep}")
        if ranks_per_node is not None and ranks_per_node < 1:
            raise InvalidArgument(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        self._pg = group
        self.keep = keep
        self._ranks_per_node = ranks_per_node
        self.timeout = timeout
        self.leave_notice = leave
        self._parts: dict[tuple[str, int], pp.Part] = {}  # (checkpoint, owner): own and held
        self._seq = 0  # the highest save number this rank has seen
        self._checkpoint: str | None = None  # the id of the save or load under way
        self._loading: _Loading | None = None
        self._local: SavePlan | None = None  # this rank's local plan of the save under way
        self._agreed: _Agreed | None = None
        self._base: Group | None = None
        self._group: Group | None = None
        self._said_none = False
        self.refused: list[str] = []  # every damaged part found, said

    # ---- the group ------------------------------------------------------------------------

    def _backend(self) -> ShardwireProcessGroup:
        pg = self._pg if self._pg is not None else dist.group.WORLD
        backend = bridged(pg) if pg is not None else None
        if backend is None:
            raise InvalidState(
                "PeerStorage needs a process group of the shardwire backend "
                "(dist.init_process_group('shardwire') first)"
            )
        return backend

    def _run(self, make: Any) -> Any:
        """Run ``make(group)`` (a coroutine function) on shardwire's loop over the
        store's own group beside the current process group."""
        backend = self._backend()
        base = backend.shardwire_group

        async def run() -> Any:
            if self._base is not base or self._group is None:
                self._base = base
                self._group = base.new_group(range(base.size), name="peer-storage")
            return await make(self._group)

        return backend.run(run(), self.timeout)

    def _per_node(self, group: Group) -> int:
        """Ranks per node of the current world (the launcher's node size), or as given."""
        if self._ranks_per_node is not None:
            return self._ranks_per_node
        base = self._base if self._base is not None else group
        return int(getattr(base, "local_world_size", 1) or 1)

    # ---- what every rank holds ------------------------------------------------------------

    def _holdings(self) -> list[pp.Held]:
        """What every live rank holds intact (a collective)."""
        for part in self._parts.values():
            if not part.intact():
                said = (
                    f"part of rank {part.owner} of checkpoint {part.checkpoint!r} failed its "
                    f"digest on this rank: not offered"
                )
                if said not in self.refused:
                    self.refused.append(said)
                    log.warning("%s", said)
        mine = pp.holdings(self._parts.values())

        async def gather(group: Group) -> list[Any]:
            return await group.all_gather_object(mine)

        held = pp.gathered(self._run(gather))
        self._seq = max([self._seq, *(h.seq for h in held)])
        return held

    def latest(self) -> str | None:
        """The newest checkpoint whose every part a live rank holds intact, the same on
        every rank (a collective: every rank of the group calls it); None when there is
        none (said once where parts are held but none whole: load the file system's
        checkpoint instead)."""
        held = self._holdings()
        whole = pp.whole(held)
        if whole:
            return whole[0]
        if held and not self._said_none:  # parts there are, but no whole checkpoint
            self._said_none = True
            log.warning(
                "no checkpoint in the ranks' memory is whole (every part held by a live "
                "rank): load one from the file system"
            )
        return None

    def leaving(self) -> bool:
        """Whether any rank was told to leave (SIGTERM, with a notice): every rank then
        saves a checkpoint to this store and calls :meth:`leave`. A collective (one small
        all-reduce); False on every rank without a notice."""
        if self.leave_notice is None:
            return False
        told = np.array([int(self.leave_notice.requested)], dtype=np.int64)

        async def ask(group: Group) -> int:
            return int((await group.all_reduce(told, "max"))[0])

        return bool(self._run(ask))

    def leave(self) -> None:
        """After the hand-over's save: once every rank has saved (and so every part is
        at its holder), the ranks told to leave raise ``LeftJob`` and the others return.
        A collective."""

        async def settle(group: Group) -> tuple[int, int]:
            await group.barrier()
            return group.rank, holder(group.rank, group.size, self._per_node(group))

        rank, to = self._run(settle)
        notice = self.leave_notice
        if notice is None or not notice.requested:
            return
        notice.disarm()  # no fallback SIGTERM while this rank ends by LeftJob
        held = self.checkpoints
        raise LeftJob(rank=rank, step=held[0] if held else "(none)", holder=to)

    @property
    def checkpoints(self) -> list[str]:
        """The checkpoints this rank holds a part of (its own or a copy), newest first."""
        seqs = {p.checkpoint: p.seq for p in self._parts.values()}
        return sorted(seqs, key=lambda c: seqs[c], reverse=True)

    # ---- both roles -----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is None:
            raise InvalidArgument(
                "PeerStorage needs a checkpoint_id: dcp.save(..., checkpoint_id=ID) or "
                "dcp.load(..., checkpoint_id=store.latest())"
            )
        self._checkpoint = os.fspath(checkpoint_id)
        self._loading = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._checkpoint)

    # ---- writing --------------------------------------------------------------------------

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        """A load's plan as it is. A save's: keep this rank's local plan and give DCP an
        empty one: the ranks plan a save into their memory among themselves
        (:meth:`write_data`, once per state-dict structure), so DCP's exchanges carry no
        items and its coordinator plans nothing. A caching planner's "unchanged" plan
        stands for the plan kept."""
        if isinstance(plan, LoadPlan):
            return plan
        if plan.usable:
            self._local = plan
        elif self._local is None:
            raise InvalidState("PeerStorage: a planner said its plan was unchanged before any")
        return SavePlan(items=[], planner_data={})

    def prepare_global_plan(self, plans: Any) -> Any:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        checkpoint = self._named()
        final, seq = self._final_plan(bool(getattr(planner, "dedup_save_to_lowest_rank", False)))
        data, places = _pack(final.items, planner)

        async def save(group: Group) -> tuple[pp.Part, pp.Part | None]:
            owned = [pp.Where(group.rank, w.offset, w.nbytes) for w in places]
            layout = pp.PartLayout(group.rank, list(final.items), owned, final.planner_data)
            own = pp.Part(checkpoint, seq, group.size, layout, data, pp.digest(data))
            return own, await self._swap(group, own)

        own, copy = self._run(save)
        self._seq = own.seq
        for key in [k for k in self._parts if k[0] == checkpoint]:
            del self._parts[key]  # the same id saved again replaces it
        self._parts[(checkpoint, own.owner)] = own
        if copy is not None:
            self._parts[(copy.checkpoint, copy.owner)] = copy
        self._trim()
        # DCP gathers the results for finish(), which needs none: every rank keeps the
        # layouts the metadata is rebuilt from
        done: Future[list[WriteResult]] = Future()
        done.set_result([])
        return done

    def _final_plan(self, to_lowest_rank: bool) -> tuple[SavePlan, int]:
        """This rank's final plan of the save under way, and the save's number. The
        ranks agree on both in one small exchange; where any rank's local plan changed
        since the plans were last agreed (or the group did: a re-formation), they
        exchange their local plans and each computes every rank's final plan
        (:func:`peerparts.final_plans`)."""
        local = self._local
        if local is None:
            raise InvalidState("PeerStorage: write_data before prepare_local_plan")
        agreed = self._agreed
        same = agreed is not None and agreed.fits(local, to_lowest_rank)

        async def agree(group: Group) -> tuple[int, list[Any] | None]:
            unchanged = same and agreed is not None and agreed.group is group
            told = await group.all_gather_object([self._seq, unchanged])
            seq = max(int(t[0]) for t in told) + 1
            if all(t[1] for t in told):
                return seq, None
            return seq, await group.all_gather_object(pp.encode_plan(local))

        seq, plans = self._run(agree)
        if plans is None:
            assert agreed is not None
            return agreed.final, seq
        final = pp.final_plans([pp.decode_plan(p) for p in plans], to_lowest_rank=to_lowest_rank)
        group = self._group  # the group the plans were exchanged over
        assert group is not None
        self._agreed = _Agreed(group, local, to_lowest_rank, final[group.rank])
        return final[group.rank], seq

    async def _swap(self, group: Group, own: pp.Part) -> pp.Part | None:
        """Send ``own`` to its holder and take the part this rank holds a copy of."""
        if group.size == 1:
            return None
        per_node = self._per_node(group)
        to = holder(group.rank, group.size, per_node)
        frm = source(group.rank, group.size, per_node)
        described = np.frombuffer(msgpack.packb(pp.describe(own)), dtype=np.uint8)
        _, _, data, raw = await asyncio.gather(
            group.send(own.data, to, tag=_DATA),
            group.send(described, to, tag=_DESCRIPTION),
            group.recv(frm, tag=_DATA),
            group.recv(frm, tag=_DESCRIPTION),
        )
        copy = pp.rebuild(msgpack.unpackb(raw.tobytes()), data)
        if not copy.intact():
            said = f"copy of rank {copy.owner}'s part of {copy.checkpoint!r} arrived damaged"
            self.refused.append(said)
            log.warning("%s: not kept", said)
            return None
        return copy

    def _trim(self) -> None:
        """Keep the newest ``keep`` checkpoints' parts."""
        kept = set(self.checkpoints[: self.keep])
        for key in [k for k in self._parts if k[0] not in kept]:
            del self._parts[key]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # every rank keeps what it needs to rebuild the metadata (peerparts.metadata)

    def _named(self) -> str:
        if self._checkpoint is None:
            raise InvalidState("PeerStorage was not given a checkpoint_id (DCP calls reset)")
        return self._checkpoint

    # ---- reading --------------------------------------------------------------------------

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        checkpoint = self._named()
        held = self._holdings()
        failure = _unavailable(held, checkpoint)
        if failure is not None:
            # DCP catches what read_metadata raises and keeps only its text: the typed
            # error is raised from set_up_storage_reader, which DCP passes on as it is
            self._loading = _Loading(failure=failure)
            return Metadata(state_dict_metadata={})
        describers = pp.assigned(held, checkpoint)

        async def outline(group: Group) -> list[Any]:
            mine = [
                pp.describe(p)
                for (c, owner), p in sorted(self._parts.items())
                if c == checkpoint and describers.get(owner) == group.rank
            ]
            return await group.all_gather_object(mine)

        layouts = [pp.layout_of(d) for per_rank in self._run(outline) for d in per_rank]
        me = self._backend().shardwire_group.rank
        self._loading = _Loading(
            metadata=pp.metadata(layouts),
            servers=pp.servers(held, checkpoint, me),
            items={i.index: i for layout in layouts for i in layout.items},
        )
        return self._loading.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        loading = self._loading
        if loading is None:
            raise InvalidState("PeerStorage: set_up_storage_reader before read_metadata")
        if loading.failure is not None:
            raise loading.failure

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        loading = self._loading
        checkpoint = self._named()
        if loading is None or loading.metadata is None:
            raise InvalidState("PeerStorage: read_data before read_metadata")
        wanted = _wanted(plan.items, loading.metadata)

        async def fetch(group: Group) -> dict[pp.Where, np.ndarray]:
            return await _fetch(group, wanted, loading.servers, self._parts, checkpoint)

        got = self._run(fetch)
        for item in plan.items:
            where = loading.metadata.storage_data[item.storage_index]
            _place(item, got[where], planner, loading.items[item.storage_index])
        done: Future[None] = Future()
        done.set_result(None)
        return done


@dataclass(frozen=True)
class _Agreed:
    """The save plans the ranks last agreed on: over which group, this rank's local
    plan then, how replicated items were placed, and this rank's final plan."""

    group: Group
    local: SavePlan
    to_lowest_rank: bool
    final: SavePlan

    def fits(self, local: SavePlan, to_lowest_rank: bool) -> bool:
        """Whether a save with this local plan may use the agreed final plan (on this
        rank's side: the group and the other ranks are asked too)."""
        return (
            self.to_lowest_rank == to_lowest_rank
            and self.local.items == local.items
            and self.local.planner_data == local.planner_data
        )


@dataclass
class _Loading:
    """A load under way: the checkpoint's metadata, which rank serves each owner's part,
    and each stored item by its index; or why it cannot be loaded."""

    metadata: Metadata | None = None
    servers: dict[int, int] = field(default_factory=dict)
    items: dict[MetadataIndex, WriteItem] = field(default_factory=dict)
    failure: CheckpointUnavailable | None = None


def _unavailable(held: Sequence[pp.Held], checkpoint: str) -> CheckpointUnavailable | None:
    """Why ``checkpoint`` cannot be loaded from the live ranks (None: it can)."""
    whole = pp.whole(held)
    newest = f"the newest whole one is {whole[0]!r}" if whole else "none is whole"
    if not held:
        return CheckpointUnavailable(
            f"no checkpoint {checkpoint!r}: nothing was saved to PeerStorage on any live "
            "rank (load the file system's checkpoint)"
        )
    if not any(h.checkpoint == checkpoint for h in held):
        return CheckpointUnavailable(
            f"no live rank holds checkpoint {checkpoint!r} ({newest}; held: "
            f"{sorted({h.checkpoint for h in held})})"
        )
    lacking = pp.missing(held, checkpoint)
    if lacking:
        return CheckpointUnavailable(
            f"checkpoint {checkpoint!r} is not whole: no live rank holds an intact part of "
            f"ranks {lacking} of the world that saved it ({newest})"
        )
    return None


# ---- bytes in and out ---------------------------------------------------------------------


def _pack(items: Sequence[WriteItem], planner: SavePlanner) -> tuple[np.ndarray, list[pp.Where]]:
    """Every item's bytes end to end, and where each lies (its owner not yet known)."""
    pieces: list[np.ndarray] = []
    places: list[pp.Where] = []
    at = 0
    for item in items:
        value = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(value, io.BytesIO)
            raw = np.frombuffer(value.getvalue(), dtype=np.uint8)
        else:
            tensor = value.to_local() if isinstance(value, DTensor) else value
            raw = _bytes_of(tensor.detach())
        places.append(pp.Where(-1, at, raw.nbytes))
        pieces.append(raw)
        at += raw.nbytes
    data = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)
    return data, places


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _wanted(items: Sequence[ReadItem], md: Metadata) -> list[pp.Where]:
    """The stored items ``items`` read from, each once (a resharded load reads several
    slices of one)."""
    seen: dict[pp.Where, None] = {}
    for item in items:
        seen.setdefault(md.storage_data[item.storage_index], None)
    return list(seen)


async def _fetch(
    group: Group,
    wanted: Sequence[pp.Where],
    servers: dict[int, int],
    parts: dict[tuple[str, int], pp.Part],
    checkpoint: str,
) -> dict[pp.Where, np.ndarray]:
    """Every rank's ``wanted`` items from the ranks that serve them: what each asks of
    each (counts, then requests), then the bytes, as two all-to-alls."""
    size = group.size
    asks: list[list[pp.Where]] = [[] for _ in range(size)]
    for where in wanted:
        asks[servers[where.owner]].append(where)
    counts = np.array([len(a) for a in asks], dtype=np.int64)
    theirs = await group.all_to_all(counts)
    rows = np.array([[w.owner, w.offset, w.nbytes] for a in asks for w in a], dtype=np.int64)
    asked = await group.all_to_all(
        rows.reshape(-1, 3),
        send_splits=[int(c) for c in counts],
        recv_splits=[int(c) for c in theirs],
    )
    # serve: each asker's ranges end to end, in its order
    replies, sizes = [], []
    for owner, offset, nbytes in asked.reshape(-1, 3).tolist():
        part = parts[(checkpoint, owner)]
        replies.append(part.data[offset : offset + nbytes])
        sizes.append(nbytes)
    per_asker = np.cumsum([0, *[int(c) for c in theirs]])
    send = [sum(sizes[per_asker[r] : per_asker[r + 1]]) for r in range(size)]
    recv = [sum(w.nbytes for w in a) for a in asks]
    flat = np.concatenate(replies) if replies else np.empty(0, dtype=np.uint8)
    got = await group.all_to_all(flat, send_splits=send, recv_splits=recv)
    out: dict[pp.Where, np.ndarray] = {}
    at = 0
    for where in (w for a in asks for w in a):
        out[where] = got[at : at + where.nbytes]
        at += where.nbytes
    return out


def _place(item: ReadItem, raw: np.ndarray, planner: LoadPlanner, stored: WriteItem) -> None:
    """Give DCP's planner one read item's value from its stored item's bytes."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(raw.tobytes()))
        return
    assert stored.tensor_data is not None
    dtype = stored.tensor_data.properties.dtype
    whole = torch.from_numpy(raw.copy()).view(dtype).reshape(stored.tensor_data.chunk.sizes)
    value = narrow_tensor_by_index(whole, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != value.size():
        raise InvalidArgument(
            f"checkpoint item {item.storage_index.fqn}: expected {tuple(target.size())}, "
            f"stored {tuple(value.size())}"
        )
    target.copy_(value)
    planner.commit_tensor(item, target)
