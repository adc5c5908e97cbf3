"""In-memory copies of the training state, each rank's held by another rank.

With live recovery (``--recovery live``) a failed rank's replacement takes its state
from a peer's memory rather than from disk, and every rank rolls back in memory to the
same step, so the run goes on exactly as if nothing had happened.

Every ``every`` steps each rank snapshots what it alone holds (its FSDP shards, its
optimizer state and step count, its random generators and the caller's ``extra``),
keeps the snapshot, and sends a copy to its *holder*: the same local rank on the next
node, so that the loss of a whole node leaves a copy of each of its ranks elsewhere (on
a single node, the next rank). The exchange runs in the background on a group of its
own while training goes on; the next snapshot first waits for it. The newest ``keep``
steps are kept, own and held (memory: ``2 * keep`` times the rank's state).

After a re-formation, :meth:`PeerCopies.restore` finds the newest step whose every
rank's snapshot is still held somewhere (by its rank, or by that rank's holder), and
every rank of the new group gathers its part from them, exactly as a disk checkpoint
is read at any world size: a rank that kept its part reads it from its own snapshot,
and only what moved crosses the wire (a replaced rank's state from its holder; on a
shrink, the lost ranks' parts spread over the survivors; on a grow, parts for the new
ranks). Snapshots and the pieces sent are checked against their xxh3 digests; one that
fails is refused, and said: the next older step is tried, then none (the caller loads
its disk checkpoint). Copies of another model or optimizer are not restored.

Given a notice to leave (``leave``: ``Session.leave_notice()``, SIGTERM), every copy
step first asks whether any rank was told to leave (one small all-reduce per copy
step). If one was, the step's copies are exchanged, every rank waits until all have
landed, and the ranks told to leave raise ``LeftJob``: the others go on, and the
re-formation that follows restores that step, so no completed step is lost.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import astuple
from typing import Any, Protocol

import numpy as np

from shardwire.protocol.errors import InvalidArgument, LeftJob
from shardwire.worker.collectives import Group, Work
from shardwire.worker.fsdp import copywire as wire
from shardwire.worker.fsdp.copyplan import (
    Have,
    Piece,
    Snapshot,
    cut,
    holder,
    pack,
    place,
    source,
    sources,
)
from shardwire.worker.fsdp.generators import generator_states, set_generator_states
from shardwire.worker.fsdp.persist import Resumed, owned_range
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.wrapper import FSDP

log = logging.getLogger(__name__)


class Notice(Protocol):
    """A notice to leave (``Session.leave_notice()``): whether SIGTERM arrived."""

    @property
    def requested(self) -> bool: ...


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


class PeerCopies:
    """A rank's snapshots and the copies it holds for another rank, across re-formations.

    Make one per process, before the first group, and keep it: call :meth:`restore`
    after building the model on each generation's group (None: nothing in memory, load
    the disk checkpoint) and :meth:`save` after every step. Every rank gives a
    ``leave`` notice, or none does (the copy step's question is a collective); a group
    of one rank has nobody to hand its state to and never leaves by it.
    """

    def __init__(
        self, every: int, *, keep: int = 2, ranks_per_node: int = 1, leave: Notice | None = None
    ) -> None:
        if every < 1 or keep < 1 or ranks_per_node < 1:
            raise InvalidArgument("every, keep and ranks_per_node must be at least 1")
        self.every, self.keep, self.ranks_per_node = every, keep, ranks_per_node
        self.leave = leave
        self._own: dict[int, Snapshot] = {}
        self._held: dict[int, Snapshot] = {}
        self._base: Group | None = None  # the generation's group the copies group is of
        self._group: Group | None = None
        self._exchange: Work[None] | None = None
        self.refused: list[str] = []  # every copy refused, said

    @property
    def state_bytes(self) -> int:
        """The bytes of this rank's newest snapshot (what its holder keeps of it)."""
        return self._own[max(self._own)].data.nbytes if self._own else 0

    def _copies(self, fsdp: FSDP) -> Group:
        if fsdp.mesh is not None and fsdp.mesh.sizes[1:] != (1, 1):
            raise InvalidArgument(
                "peer copies hold FSDP state of plain data parallelism; a tensor-parallel or "
                "pipeline layout (a mesh with tp or pp above 1) restores from disk checkpoints"
            )
        if self._base is not fsdp.group or self._group is None:
            self._base = fsdp.group
            self._group = fsdp.group.new_group(range(fsdp.group.size), name="peer-copies")
            self._exchange = None  # the old generation's, gone with its group
        return self._group

    def _keep(self, store: dict[int, Snapshot], snap: Snapshot) -> None:
        store[snap.step] = snap
        for step in sorted(store)[: -self.keep]:
            del store[step]

    async def save(
        self,
        fsdp: FSDP,
        step: int,
        *,
        rngs: dict[str, np.random.Generator] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """After training step ``step``: every ``every`` steps, snapshot this rank and
        send the copy to its holder in the background (waiting for the previous one)."""
        if step % self.every:
            return
        group = self._copies(fsdp)
        await self.wait()  # the previous copy's errors surface here
        leaving = (
            self.leave is not None and group.size > 1 and await _anyone_leaving(group, self.leave)
        )
        self._take(fsdp, group, step, generator_states(fsdp, rngs or {}), extra or {})
        if leaving:
            await self._hand_over(group, step)

    def _take(
        self, fsdp: FSDP, group: Group, step: int, rngs: dict[str, str], extra: dict[str, Any]
    ) -> None:
        """Snapshot this rank at ``step``, keep it, and send its copy in the background."""
        shards, shard = _geometry(fsdp)
        info = {
            "step": step,
            "rank": group.rank,
            "world": group.size,
            "shards": shards,
            "shard": shard,
            "numels": [u.layout.numel for u in fsdp.all_units()],
            "kind": {k: v for k, v in _kind(fsdp).items() if k != "slots"},
            "steps": fsdp.optimizer.steps,
            "rngs": rngs,
            "extra": extra,
        }
        snap = pack(layout_of(fsdp), info)
        self._keep(self._own, snap)
        if group.size > 1:
            self._exchange = group.spawn(self._swap(group, snap))

    async def _hand_over(self, group: Group, step: int) -> None:
        """A rank was told to leave: once every copy of ``step`` is at its holder, the
        ranks told to leave do (the others go on; a re-formation restores ``step``)."""
        await self.wait()
        await group.barrier()  # every holder has its copy
        if self.leave is not None and self.leave.requested:
            to = holder(group.rank, group.size, self.ranks_per_node)
            raise LeftJob(rank=group.rank, step=step, holder=to)

    async def wait(self) -> None:
        """Until the copy in flight has landed at its holder (and the one this rank holds
        has arrived): before a planned stop, say."""
        if self._exchange is not None:
            exchange, self._exchange = self._exchange, None
            await exchange.wait()

    async def _swap(self, group: Group, snap: Snapshot) -> None:
        world, me = group.size, group.rank
        to, of = holder(me, world, self.ranks_per_node), source(me, world, self.ranks_per_node)
        _sent, got = await asyncio.gather(wire.send(group, to, snap), wire.receive(group, of))
        if got.intact():
            self._keep(self._held, got)
        else:
            self._refuse(f"the copy of rank {of}'s state at step {got.step} (received)")

    def _refuse(self, what: str) -> None:
        said = f"{what} does not match its digest: refused"
        self.refused.append(said)
        log.warning("%s", said)

    async def restore(
        self, fsdp: FSDP, *, rngs: dict[str, np.random.Generator] | None = None
    ) -> Resumed | None:
        """Every rank of ``fsdp``'s group (a new generation's: the same ranks, fewer or
        more) rolls back to the newest step whose every rank's copy is still held
        somewhere; None when there is none (the caller loads its disk checkpoint).
        Copies of another model or optimizer are dropped."""
        group = self._copies(fsdp)
        kind = _kind(fsdp)
        for store in (self._own, self._held):
            for step in list(store):
                snap = store[step]
                if not _fits(snap, kind):
                    del store[step]
                elif not snap.intact():
                    self._refuse(f"the copy of rank {snap.have.rank}'s state at step {step} (held)")
                    del store[step]
        said = await group.all_gather_object(
            {
                "have": [[s.step, *astuple(s.have)] for s in self._snapshots()],
                "want": list(_geometry(fsdp)),
            }
        )
        want = [tuple(s["want"]) for s in said]
        by_step: dict[int, list[list[Have]]] = {}
        for r, s in enumerate(said):
            for step, *have in s["have"]:
                by_step.setdefault(step, [[] for _ in said])[r].append(Have(*have))
        for step in sorted(by_step, reverse=True):
            plan = sources(by_step[step], want, kind["numels"])
            if plan is None:
                continue
            got = await self._gather(group, step, plan, want)
            everyone = await group.all_gather_object(got is not None)
            if all(everyone):
                assert got is not None
                return await self._load(fsdp, group, step, got, rngs)
        return None

    def _snapshots(self) -> list[Snapshot]:
        return [*self._own.values(), *self._held.values()]

    def _find(self, step: int, old: int) -> Snapshot:
        return next(s for s in self._snapshots() if s.step == step and s.have.rank == old)

    async def _gather(
        self,
        group: Group,
        step: int,
        plan: list[list[tuple[int, int]]],
        want: list[tuple[int, ...]],
    ) -> tuple[list[Piece], dict[str, Any]] | None:
        """This rank's pieces of ``step`` (its own and those the plan has others send it),
        sending what the plan asks of it; with the snapshot meta of its own old rank.
        None if a piece sent here failed its digest."""
        me = group.rank
        sends = [
            wire.send_pieces(group, to, self._find(step, old), want[to])
            for to, pairs in enumerate(plan)
            for server, old in pairs
            if server == me and to != me
        ]
        mine = [old for server, old in plan[me] if server == me]
        received_from = [(server, old) for server, old in plan[me] if server != me]
        received = [wire.receive_pieces(group, server, old) for server, old in received_from]
        _sent, answers = await asyncio.gather(asyncio.gather(*sends), asyncio.gather(*received))
        pieces: list[Piece] = []
        metas: dict[int, dict[str, Any]] = {}
        for old in mine:
            snap = self._find(step, old)
            pieces += cut(snap, *want[me])
            metas[old] = snap.meta
        intact = True
        for (server, old), (meta, got, ok) in zip(received_from, answers, strict=True):
            if not ok:
                self._refuse(f"the copy of rank {old}'s state at step {step} (from rank {server})")
                intact = False
            pieces += got
            metas[old] = meta
        world = int(next(iter(metas.values()))["world"])
        return (pieces, metas[me if me < world else 0]) if intact else None

    async def _load(
        self,
        fsdp: FSDP,
        group: Group,
        step: int,
        got: tuple[list[Piece], dict[str, Any]],
        rngs: dict[str, np.random.Generator] | None,
    ) -> Resumed:
        pieces, meta = got
        units = fsdp.all_units()
        slots = sorted({name.split(":", 1)[1] for name, _s, _d in meta["layout"]} - {"param"})
        dtypes = {name: np.dtype(dtype) for name, _shape, dtype in meta["layout"]}
        targets: dict[str, np.ndarray] = {}
        for index, unit in enumerate(units):
            for slot in ["param", *slots]:
                name = f"{index}:{slot}"  # each array's own dtype (an empty unit's may differ)
                targets[name] = np.zeros_like(unit.shard, dtype=dtypes[name])
        bases = [owned_range(unit)[0] for unit in units]
        place(pieces, targets, bases)
        state = []
        for index, unit in enumerate(units):
            unit.shard[...] = targets[f"{index}:param"]
            await unit.reload()
            state.append({slot: targets[f"{index}:{slot}"] for slot in slots})
        if slots:
            fsdp.optimizer.set_state(state)
        for unit in units:
            unit.page_out()
        fsdp.optimizer.steps = int(meta["steps"])
        if int(meta["rank"]) == fsdp.group.rank:  # a rank the old group had: its streams
            set_generator_states(fsdp, rngs or {}, meta["rngs"])
        # the abandoned steps after it are gone (training repeats them); the state
        # restored is snapshotted and copied at once, in this group's parts and
        # placement, so a failure before the next copy step rolls back to it again
        for store in (self._own, self._held):
            for later in [s for s in store if s > step]:
                del store[later]
        self._take(fsdp, group, step, generator_states(fsdp, rngs or {}), dict(meta["extra"]))
        return Resumed(step, dict(meta["extra"]), None)


def _geometry(fsdp: FSDP) -> tuple[int, int]:
    """Which part of each unit's flat buffer this rank holds: ``(shards, shard)``."""
    units = fsdp.all_units()
    if not units or not units[0].strategy.shards_grads:
        return 1, 0
    return units[0].layout.shards, units[0].shard_group.rank


def _kind(fsdp: FSDP) -> dict[str, Any]:
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


def _fits(snap: Snapshot, kind: dict[str, Any]) -> bool:
    """Whether ``snap`` was taken of this model and optimizer (whose slots, once it has
    any, must be the snapshot's)."""
    slots = sorted({n.split(":", 1)[1] for n, _s, _d in snap.meta["layout"]} - {"param"})
    same = all(snap.meta["kind"][k] == kind[k] for k in ("numels", "dtypes", "optimizer"))
    return same and (kind["slots"] is None or kind["slots"] == slots)


async def _anyone_leaving(group: Group, leave: Notice) -> bool:
    """Whether any rank was told to leave (every rank asks at the same copy step)."""
    told = await group.all_reduce(np.array([int(leave.requested)], np.int64), "max")
    return bool(told[0])
