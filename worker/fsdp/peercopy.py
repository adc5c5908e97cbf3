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

After a re-formation, :meth:`PeerCopies.restore` finds the newest step that every rank
can restore (from its own snapshot, or from its holder's copy), has each holder send
the copies that are missing, checks every copy's xxh3 digest, and loads it. A copy that
fails its check is refused, and said: the next older step is tried, then none (the
caller loads its disk checkpoint). Copies are bound to the layout they were taken in
(world size, strategy, model): a re-formation at another world size restores from disk.

Given a notice to leave (``leave``: ``Session.leave_notice()``, SIGTERM), every copy
step first asks whether any rank was told to leave (one small all-reduce per copy
step). If one was, the step's copies are exchanged, every rank waits until all have
landed, and the ranks told to leave raise ``LeftJob``: the others go on, and the
re-formation that follows restores that step, so no completed step is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np
import xxhash

from shardwire.protocol.errors import InvalidArgument, LeftJob
from shardwire.worker.collectives import Group, Work
from shardwire.worker.fsdp.generators import generator_states, set_generator_states
from shardwire.worker.fsdp.persist import Resumed
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.wrapper import FSDP

log = logging.getLogger(__name__)

_HEADER, _DATA = 1, 2  # point-to-point tags of a copy's two messages


class Notice(Protocol):
    """A notice to leave (``Session.leave_notice()``): whether SIGTERM arrived."""

    @property
    def requested(self) -> bool: ...


# ---- pure core ---------------------------------------------------------------------------


def holder(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank that holds ``rank``'s copy: the same local rank on the next node, or on
    a single node the next rank."""
    stride = ranks_per_node if world > ranks_per_node else 1
    return (rank + stride) % world


def source(rank: int, world: int, ranks_per_node: int) -> int:
    """The rank whose copy ``rank`` holds (the inverse of :func:`holder`)."""
    stride = ranks_per_node if world > ranks_per_node else 1
    return (rank - stride) % world


def choose(
    own: Sequence[Sequence[int]],
    held: Sequence[Sequence[int]],
    holder_of: Callable[[int], int],
    refused: set[int] = frozenset(),  # type: ignore[assignment]
) -> tuple[int, list[int]] | None:
    """The newest step every rank can restore (``own[r]``: the steps rank r snapshotted;
    ``held[r]``: those of the copies it holds), and the ranks that need their holder's
    copy of it; None if there is no such step (outside ``refused``)."""
    steps = {s for steps in own for s in steps} | {s for steps in held for s in steps}
    for step in sorted(steps - set(refused), reverse=True):
        need = [r for r in range(len(own)) if step not in own[r]]
        if all(step in held[holder_of(r)] for r in need):
            return step, need
    return None


@dataclass
class Snapshot:
    """One rank's state at a step: its arrays' bytes end to end, and what they are."""

    meta: dict[str, Any]  # step, rank, layout, optimizer steps, generators, extra, digest
    data: np.ndarray  # uint8

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def intact(self) -> bool:
        return _digest(self.data) == self.meta["digest"]

    def arrays(self) -> list[np.ndarray]:
        """Copies of the arrays, in layout order (the snapshot stays as it is)."""
        out, at = [], 0
        for _name, shape, dtype in self.meta["layout"]:
            kind = np.dtype(dtype)
            size = int(np.prod(shape)) * kind.itemsize
            out.append(self.data[at : at + size].view(kind).reshape(shape).copy())
            at += size
        return out


def _digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(data.data)  # the bytes, no copy


def pack(arrays: Sequence[tuple[str, np.ndarray]], info: dict[str, Any]) -> Snapshot:
    """A snapshot of named ``arrays`` (copied) with ``info`` (step, rank, ...)."""
    data = np.empty(sum(a.nbytes for _n, a in arrays), np.uint8)
    at = 0
    for _name, array in arrays:
        data[at : at + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        at += array.nbytes
    layout = [[name, list(a.shape), a.dtype.str] for name, a in arrays]
    meta = {**info, "layout": layout, "digest": _digest(data)}
    return Snapshot(meta, data)


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
        info = {
            "step": step,
            "rank": group.rank,
            "steps": fsdp.optimizer.steps,
            "rngs": generator_states(fsdp, rngs or {}),
            "extra": extra or {},
        }
        snap = pack(layout_of(fsdp), info)
        self._keep(self._own, snap)
        if group.size > 1:
            self._exchange = group.spawn(self._swap(group, snap))
        if leaving:
            await self._hand_over(group, step)

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
        _sent, got = await asyncio.gather(_send(group, to, snap), _receive(group, of))
        if self._accept(got, of, "received"):
            self._keep(self._held, got)

    def _accept(self, snap: Snapshot, rank: int, how: str) -> bool:
        if snap.intact():
            return True
        said = (
            f"the copy of rank {rank}'s state at step {snap.step} ({how}) does not match its "
            "digest: refused"
        )
        self.refused.append(said)
        log.warning("%s", said)
        return False

    async def restore(
        self, fsdp: FSDP, *, rngs: dict[str, np.random.Generator] | None = None
    ) -> Resumed | None:
        """Every rank of ``fsdp``'s group (a new generation's, the same ranks) rolls back
        to the newest step all can restore; None when there is none (the caller loads
        its disk checkpoint). Copies taken at another layout are dropped."""
        group = self._copies(fsdp)
        mine = [(name, array.shape, array.dtype.str) for name, array in layout_of(fsdp)]
        for store in (self._own, self._held):
            for step in [s for s, snap in store.items() if not _fits(snap, mine, fsdp)]:
                del store[step]
        said = await group.all_gather_object({"own": sorted(self._own), "held": sorted(self._held)})
        own, held = [s["own"] for s in said], [s["held"] for s in said]
        world, me = group.size, group.rank

        def holder_of(rank: int) -> int:
            return holder(rank, world, self.ranks_per_node)

        refused: set[int] = set()
        while (choice := choose(own, held, holder_of, refused)) is not None:
            step, need = choice
            sends = [_send(group, rank, self._held[step]) for rank in need if holder_of(rank) == me]
            received = [_receive(group, holder_of(me))] if me in need else []
            results = await asyncio.gather(*sends, *received)
            ok = True
            if received:
                got = results[-1]
                assert isinstance(got, Snapshot)
                ok = got.step == step and self._accept(got, me, "sent back by its holder")
                if ok:
                    self._keep(self._own, got)
            everyone = await group.all_gather_object(ok)
            if all(everyone):
                return await self._load(fsdp, self._own[step], rngs)
            refused.add(step)
        return None

    async def _load(
        self, fsdp: FSDP, snap: Snapshot, rngs: dict[str, np.random.Generator] | None
    ) -> Resumed:
        arrays = dict(zip([n for n, _s, _d in snap.meta["layout"]], snap.arrays(), strict=True))
        state = []
        for index, unit in enumerate(fsdp.all_units()):
            unit.shard[...] = arrays[f"{index}:param"]
            await unit.reload()
            prefix = f"{index}:"
            state.append({k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)})
            del state[-1]["param"]
        if any(state):
            fsdp.optimizer.set_state(state)
        for unit in fsdp.all_units():
            unit.page_out()
        fsdp.optimizer.steps = int(snap.meta["steps"])
        set_generator_states(fsdp, rngs or {}, snap.meta["rngs"])
        # the abandoned steps after it are gone (training repeats them)
        for store in (self._own, self._held):
            for step in [s for s in store if s > snap.step]:
                del store[step]
        return Resumed(snap.step, dict(snap.meta["extra"]), None)


def _fits(snap: Snapshot, mine: list[tuple[str, Any, str]], fsdp: FSDP) -> bool:
    """A snapshot taken in this layout (an optimizer not yet stepped has no slots)."""
    layout = [(n, tuple(s), d) for n, s, d in snap.meta["layout"]]
    params = [(n, tuple(s), d) for n, s, d in mine if n.endswith(":param")]
    if fsdp.optimizer.state:
        return layout == [(n, tuple(s), d) for n, s, d in mine]
    return [entry for entry in layout if entry[0].endswith(":param")] == params


async def _anyone_leaving(group: Group, leave: Notice) -> bool:
    """Whether any rank was told to leave (every rank asks at the same copy step)."""
    told = await group.all_reduce(np.array([int(leave.requested)], np.int64), "max")
    return bool(told[0])


async def _send(group: Group, to: int, snap: Snapshot) -> None:
    header = np.frombuffer(msgpack.packb(snap.meta), np.uint8)
    await group.send(header, to, tag=_HEADER)
    await group.send(snap.data, to, tag=_DATA)


async def _receive(group: Group, of: int) -> Snapshot:
    header = await group.recv(of, tag=_HEADER)
    meta = msgpack.unpackb(np.ascontiguousarray(header).tobytes())
    data = await group.recv(of, tag=_DATA)
    return Snapshot(meta, np.ascontiguousarray(data).view(np.uint8).reshape(-1))
