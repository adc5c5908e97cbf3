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

With a mesh (tensor-parallel slices, pipeline stages) the copies move within FSDP's
data-parallel group, and every group of the mesh restores the same step and hands over
at the same one.

Replicas that train apart (DiLoCo's) are copied across the job with
:meth:`PeerCopies.replicas`: each snapshot is of its rank's replica and restores only
into that replica (:class:`~shardwire.worker.fsdp.dilococopies.DiLoCoCopies` adds
the outer state).

``save`` also notes, every step, what it was called with; the last generation's model,
if its optimizer took no further step since, then serves as a snapshot of that step.
Where a replica holds a lost rank's values (NO_SHARD, HYBRID_SHARD), and every survivor
stopped after the same step, nothing is rolled back.

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
    Source,
    cut,
    holder,
    place,
    source,
    sources,
)
from shardwire.worker.fsdp.copystate import Live, fits, geometry, kind, snapshot
from shardwire.worker.fsdp.generators import generator_states, set_generator_states
from shardwire.worker.fsdp.persist import Resumed, owned_range
from shardwire.worker.fsdp.wrapper import FSDP

log = logging.getLogger(__name__)


class LeaveSignal(Protocol):
    """A notice to leave (``Session.leave_notice()``): whether SIGTERM arrived."""

    @property
    def requested(self) -> bool: ...


class PeerCopies:
    """A rank's snapshots and the copies it holds for another rank, across re-formations.

    Make one per process, before the first group, and keep it: call :meth:`restore`
    after building the model on each generation's group (None: nothing in memory, load
    the disk checkpoint) and :meth:`save` after every step. Every rank gives a
    ``leave`` notice, or none does (the copy step's question is a collective); a group
    of one rank has nobody to hand its state to and never leaves by it.
    """

    def __init__(
        self,
        every: int,
        *,
        keep: int = 2,
        ranks_per_node: int = 1,
        leave: LeaveSignal | None = None,
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
        self._live: Live | None = None  # the last save's model and step
        self._per_node = ranks_per_node  # the copies group's ranks per node
        self._scope: tuple[Group, int] | None = None  # replicas: (the job's group, replica)

    def replicas(self, world: Group | None, replica: int = 0) -> None:
        """Copies of replicas that train apart (DiLoCo's): they move over ``world`` (all
        the replicas' ranks, one replica's ranks on each node), so a lost replica's state
        is held by another replica's ranks; each snapshot is of this rank's ``replica``
        (its family) and restores only into that replica. None: over FSDP's group."""
        self._scope = None if world is None else (world, replica)
        self._base = None

    @property
    def state_bytes(self) -> int:
        """The bytes of this rank's newest snapshot (what its holder keeps of it)."""
        return self._own[max(self._own)].data.nbytes if self._own else 0

    def _copies(self, fsdp: FSDP) -> Group:
        """The group the copies move in: over FSDP's group (with a mesh, its data-parallel
        group: the ranks of one pipeline stage and tensor-parallel slice, which hold the
        same units)."""
        base = fsdp.group if self._scope is None else self._scope[0]
        if self._scope is not None and self._whole(fsdp) is not None:
            raise InvalidArgument("copies across replicas need FSDP alone in each replica")
        if self._base is not base or self._group is None:
            self._base = base
            self._group = base.new_group(range(base.size), name="peer-copies")
            self._exchange = None  # the old generation's, gone with its group
            # a mesh's data-parallel ranks on one node: its ranks over the tp slices
            tp = fsdp.mesh.sizes[2] if fsdp.mesh is not None else 1
            self._per_node = max(1, self.ranks_per_node // tp)
        return self._group

    @staticmethod
    def _whole(fsdp: FSDP) -> Group | None:
        """With a mesh of several stages or slices, the group of all its ranks: they must
        restore the same step and hand over at the same one."""
        mesh = fsdp.mesh
        return mesh.group if mesh is not None and mesh.group.size > fsdp.group.size else None

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
        """After training step ``step``: note it (should a failure come before the next
        step changes the model, its state serves as this step's), and every ``every``
        steps snapshot this rank and send the copy to its holder in the background
        (waiting for the previous one)."""
        states = generator_states(fsdp, rngs or {})
        self._live = Live(fsdp, step, fsdp.optimizer.steps, states, dict(extra or {}))
        if step % self.every:
            return
        group = self._copies(fsdp)
        await self.wait()  # the previous copy's errors surface here
        whole = self._whole(fsdp) or group
        leaving = (
            self.leave is not None and group.size > 1 and await _anyone_leaving(whole, self.leave)
        )
        self._take(fsdp, group, step, states, extra or {})
        if leaving:
            await self._hand_over(group, whole, step)

    def _take(
        self, fsdp: FSDP, group: Group, step: int, rngs: dict[str, str], extra: dict[str, Any]
    ) -> None:
        """Snapshot this rank at ``step``, keep it, and send its copy in the background."""
        family = self._scope[1] if self._scope is not None else 0
        snap = snapshot(fsdp, step, rngs, extra, where=(group.rank, group.size, family))
        self._keep(self._own, snap)
        if group.size > 1:
            self._exchange = group.spawn(self._swap(group, snap))

    def _adopt_live(self, fsdp: FSDP) -> list[int] | None:
        """Before a restore: the state the last generation's model holds, as a snapshot of
        the step it was last saved after, if nothing changed it since (its optimizer took
        no further step; with offload it is gone). Under NO_SHARD and HYBRID_SHARD another
        replica's then serves a lost rank's part, and nothing is rolled back. Says what it
        found: None (no save in this process), else ``[step, old rank, added]`` (step -1:
        the state moved on)."""
        live, self._live = self._live, None
        if live is None or live.fsdp is fsdp or self._scope is not None:
            return None
        old = live.fsdp
        if old.offload is not None or old.optimizer.steps != live.steps:
            return [-1, old.group.rank, 0]
        if live.step in self._own:  # a copy step: its snapshot is this state
            return [live.step, old.group.rank, 0]
        self._own[live.step] = snapshot(old, live.step, live.rngs, live.extra)
        return [live.step, old.group.rank, 1]

    async def _hand_over(self, group: Group, whole: Group, step: int) -> None:
        """A rank was told to leave: once every copy of ``step`` is at its holder (in
        every group of a mesh), the ranks told to leave do (the others go on; a
        re-formation restores ``step``)."""
        await self.wait()
        await whole.barrier()  # every holder has its copy
        if self.leave is not None and self.leave.requested:
            to = holder(group.rank, group.size, self._per_node)
            raise LeftJob(rank=group.ranks[group.rank], step=step, holder=group.ranks[to])

    async def wait(self) -> None:
        """Until the copy in flight has landed at its holder (and the one this rank holds
        has arrived): before a planned stop, say."""
        if self._exchange is not None:
            exchange, self._exchange = self._exchange, None
            await exchange.wait()

    async def _swap(self, group: Group, snap: Snapshot) -> None:
        world, me = group.size, group.rank
        to, of = holder(me, world, self._per_node), source(me, world, self._per_node)
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
        live = self._adopt_live(fsdp)
        mine = kind(fsdp)
        for store in (self._own, self._held):
            for step in list(store):
                snap = store[step]
                if not fits(snap, mine):
                    del store[step]
                elif not snap.intact():
                    self._refuse(f"the copy of rank {snap.have.rank}'s state at step {step} (held)")
                    del store[step]
        said = await group.all_gather_object(
            {
                "have": [[s.step, *astuple(s.have)] for s in self._snapshots()],
                "want": list(geometry(fsdp)),
                "family": self._scope[1] if self._scope is not None else 0,
                "live": live,
            }
        )
        want = [tuple(s["want"]) for s in said]
        whole = self._whole(fsdp)  # a mesh's other groups must agree on the step too
        # the survivors' live states serve only if all stopped after the same step's save
        # (one that stopped in a later step's logging, say, would miss that step's record)
        lives = [s["live"] for s in said if s["live"] is not None]
        stopped = {step for step, _old, _added in lives}
        if whole is not None:
            stopped = set().union(*await whole.all_gather_object(sorted(stopped)))
        drop = {(step, old) for step, old, added in lives if added} if len(stopped) > 1 else set()
        if drop and live is not None and live[2]:
            del self._own[live[0]]
        by_step: dict[int, list[list[Have]]] = {}
        for r, s in enumerate(said):
            for step, *have in s["have"]:
                if (step, have[0]) not in drop:
                    by_step.setdefault(step, [[] for _ in said])[r].append(Have(*have))
        families = [s["family"] for s in said]
        plans = {step: sources(by_step[step], want, mine["numels"], families) for step in by_step}
        steps = {step for step, plan in plans.items() if plan is not None}
        if whole is not None:  # the steps every group of the mesh can restore
            steps = set.intersection(*map(set, await whole.all_gather_object(sorted(steps))))
        for step in sorted(steps, reverse=True):
            plan = plans[step]
            assert plan is not None
            got = await self._gather(group, step, plan, want)
            everyone = await (whole or group).all_gather_object(got is not None)
            if all(everyone):
                assert got is not None
                return await self._load(fsdp, group, step, got, rngs)
        if by_step and group.rank == 0:
            held = {s: sorted({h.rank for row in rows for h in row}) for s, rows in by_step.items()}
            log.warning(
                "no step can be restored from the peers' copies (the old ranks each step's "
                "copies are held of: %s; steps every group of the mesh can restore: %s)",
                dict(sorted(held.items())),
                sorted(steps),
            )
        return None

    def _snapshots(self) -> list[Snapshot]:
        return [*self._own.values(), *self._held.values()]

    def _find(self, step: int, old: int) -> Snapshot:
        return next(s for s in self._snapshots() if s.step == step and s.meta["rank"] == old)

    async def _gather(
        self,
        group: Group,
        step: int,
        plan: list[Source],
        want: list[tuple[int, ...]],
    ) -> tuple[list[Piece], dict[str, Any]] | None:
        """This rank's pieces of ``step`` (its own and those the plan has others send it),
        sending what the plan asks of it; with the snapshot meta the plan names for it.
        None if a piece sent here failed its digest."""
        me = group.rank
        sends = [
            wire.send_pieces(group, to, self._find(step, old), want[to])
            for to, source in enumerate(plan)
            for server, old in source.pairs
            if server == me and to != me
        ]
        mine = [old for server, old in plan[me].pairs if server == me]
        received_from = [(server, old) for server, old in plan[me].pairs if server != me]
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
        return (pieces, metas[plan[me].meta]) if intact else None

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
        if group.rank < int(meta["world"]):  # a rank the old group had: its streams
            set_generator_states(fsdp, rngs or {}, meta["rngs"])
        # the abandoned steps after it are gone (training repeats them); the state
        # restored is snapshotted and copied at once, in this group's parts and
        # placement, so a failure before the next copy step rolls back to it again
        for store in (self._own, self._held):
            for later in [s for s in store if s > step]:
                del store[later]
        self._take(fsdp, group, step, generator_states(fsdp, rngs or {}), dict(meta["extra"]))
        return Resumed(step, dict(meta["extra"]), None)


async def _anyone_leaving(group: Group, leave: LeaveSignal) -> bool:
    """Whether any rank was told to leave (every rank asks at the same copy step)."""
    told = await group.all_reduce(np.array([int(leave.requested)], np.int64), "max")
    return bool(told[0])
