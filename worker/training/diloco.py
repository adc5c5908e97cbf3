"""DiLoCo: replicas that train on their own for ``every`` steps, then average how far they
moved and take one outer optimizer step (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models"; the streaming form after Douillard et al.
2025, "Streaming DiLoCo with overlapping communication").

Theory of operation. Each replica (one rank, or the ranks of one host training with FSDP
inside it) holds its own parameters θᵢ and every replica holds the same *global*
parameters θ. The outer group has one rank per replica holding the same part of the
model (with FSDP inside a host: the ranks with the same index in each host, which hold
the same shard). After every ``every`` inner steps, each rank computes its outer gradient
Δᵢ = θ - θᵢ, the outer group averages it (one all-reduce, or one all-gather of int8/int4
blocks summed in rank order), the outer optimizer (SGD with Nesterov momentum) updates θ
with the average, and θᵢ takes the new θ. Between syncs nothing crosses the outer group.

Streaming (``fragments=P``): the parameters are cut into P contiguous fragments and
fragment p syncs when the inner step count is ``p * every // P`` modulo ``every``: the
same bytes per round, a P-th of them at a time. Fragments sync one after another in
index order on every rank, so no two ranks can wait on different exchanges. The cuts
are made in the whole model's elements: where each rank holds a shard of every
parameter (a torch model sharded by FSDP2, whose outer group is the same shard of every
replica), a model that says where its shards lie (``places()``) has each element sync
at the step it would in the whole model, so the run is the whole model's run.

Overlap (``overlap=True``): a fragment's exchange starts after an inner step and is
finished after the next one, while that step computes. The fragment then takes the new
θ plus what the replica learnt during the exchange (θᵢ at finish minus θᵢ at start).

State (:meth:`DiLoCo.state_dict`) is the global parameters, each fragment's outer
momentum, the inner step count and an exchange in flight (its sum, already received),
so a run resumed from it continues bit for bit.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from shardwire.protocol.errors import InvalidArgument, InvalidState
from shardwire.worker.collectives import Group
from shardwire.worker.collectives.process import ProcessGroup
from shardwire.worker.collectives.work import Work
from shardwire.worker.nn.module import Module
from shardwire.worker.optim.optimizers import SGD
from shardwire.worker.training import outer_state
from shardwire.worker.training import quantize as blocks

__all__ = ["DiLoCo", "Phase", "Sharded", "replica_groups", "replica_rows"]


class Sharded(Protocol):
    """A model trained as shards (FSDP): its parameter shards, and a way to replace them."""

    def shards(self) -> list[tuple[np.ndarray, np.ndarray]]: ...

    async def update_shards(self, values: list[np.ndarray]) -> None: ...


class Phase(enum.Enum):
    """Where a DiLoCo replica is in its round."""

    INNER = "inner"  # training on its own; no exchange in flight
    EXCHANGING = "exchanging"  # one fragment's exchange started, not yet applied


class _Flight(NamedTuple):
    """One fragment's exchange in flight."""

    fragment: int
    started: int  # the inner step after which it started
    sent: np.ndarray  # the replica's fragment when the exchange started
    work: Work[np.ndarray] | None  # None: the sum below was received already
    summed: np.ndarray | None


class DiLoCo:
    """Outer synchronisation of ``model`` over ``group`` every ``every`` inner steps.

    Args:
        model: a :class:`~shardwire.worker.nn.module.Module` (its parameters are
            updated in place), or an FSDP-wrapped model (its shards).
        group: the outer group, one rank per replica.
        every: inner steps between two syncs of a fragment (H).
        outer_lr: the outer optimizer's learning rate (the paper's 0.7).
        outer_momentum: its momentum (0.9); with ``outer_lr=1``, 0 and
            ``nesterov=False`` the outer step averages the replicas.
        nesterov: Nesterov momentum (as in the paper).
        fragments: how many parts of the model sync at staggered steps (P <= H).
        overlap: finish each exchange one inner step after starting it.
        quantize: ``None`` (the outer gradient's own dtype), ``"int8"`` or ``"int4"``.
        block: values per quantization scale.
    """

    def __init__(
        self,
        model: Module | Sharded,
        group: Group,
        *,
        every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        overlap: bool = False,
        quantize: str | None = None,
        block: int = 256,
    ) -> None:
        if every < 1:
            raise InvalidArgument(f"DiLoCo needs every >= 1 inner steps, got {every}")
        if not 1 <= fragments <= every:
            raise InvalidArgument(
                f"DiLoCo fragments must be between 1 and every={every}, got {fragments}"
            )
        if quantize not in (None, "int8", "int4"):
            raise InvalidArgument(f"DiLoCo quantize must be int8, int4 or None, got {quantize!r}")
        self.model = model
        self.group = group
        self.every = every
        self.overlap = overlap
        self.bits = None if quantize is None else int(quantize[3:])
        self.block = block
        arrays = self._arrays()
        self._sizes = [a.size for a in arrays]
        total = sum(self._sizes)
        places = getattr(model, "places", None)
        # fragments are cut in the whole model: a shard may hold none of one (it syncs
        # nothing then, as the other holders of that shard do)
        whole = places()[1] if places is not None else total
        if fragments > whole:
            raise InvalidArgument(f"{fragments} fragments for {whole} parameters")
        self.dtype = np.result_type(*arrays) if arrays else np.dtype(np.float32)
        self.global_params = self._read(0, total)
        cuts = _cuts(fragments, self._sizes, places)
        self.bounds = [(int(lo), int(hi)) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        if self.bits is not None:  # checks the block before the first sync
            self._layout(0)
        self.outer = [
            SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov) for _ in self.bounds
        ]
        self.steps = 0  # inner steps taken
        # whether each fragment of this replica differs from the global parameters
        self.behind = [False] * fragments
        self.sent_bytes = 0  # payload bytes this rank contributed to outer exchanges
        self.largest_sent = 0  # the largest of them in one exchange (the peak to carry)
        self._flight: _Flight | None = None

    def _layout(self, count: int) -> blocks.CodeLayout:
        assert self.bits is not None
        return blocks.layout(count, bits=self.bits, block=self.block)

    # ---- the parameters, as one flat vector -------------------------------------------

    def _arrays(self) -> list[np.ndarray]:
        if isinstance(self.model, Module):
            return [p for _, p in self.model.named_parameters()]
        return [shard for shard, _ in self.model.shards()]

    def _pieces(self, lo: int, hi: int):
        """(array index, start, stop within it, start within [lo, hi)) for each piece."""
        offset = 0
        for index, size in enumerate(self._sizes):
            start, stop = max(lo, offset), min(hi, offset + size)
            if start < stop:
                yield index, start - offset, stop - offset, start - lo
            offset += size

    def _read(self, lo: int, hi: int) -> np.ndarray:
        arrays = self._arrays()
        out = np.empty(hi - lo, dtype=self.dtype)
        for index, a, b, at in self._pieces(lo, hi):
            out[at : at + b - a] = arrays[index].reshape(-1)[a:b]
        return out

    async def _write(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Parameters ``[lo, hi)`` take ``values``: in place for a module; for shards, a
        copy of each touched one, handed back through ``update_shards``."""
        sharded = not isinstance(self.model, Module)
        fresh = self._arrays()
        for index, a, b, at in self._pieces(lo, hi):
            if sharded:
                fresh[index] = fresh[index].copy()
            fresh[index].flat[a:b] = values[at : at + b - a]
        if sharded:
            await self.model.update_shards(fresh)  # type: ignore[union-attr]

    # ---- the round ----------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return Phase.INNER if self._flight is None else Phase.EXCHANGING

    def due(self, step: int) -> int | None:
        """The fragment that syncs after inner step ``step`` (1-based), if one does."""
        count = len(self.bounds)
        for fragment in range(count):
            if step > 0 and step % self.every == fragment * self.every // count:
                return fragment
        return None

    async def begin(self) -> None:
        """Start every replica from the outer group's rank 0 parameters."""
        await self.group.broadcast(self.global_params)
        await self._write(0, self.global_params.size, self.global_params)

    async def step(self) -> None:
        """Call after each inner optimizer step: syncs the fragment that is due."""
        self.steps += 1
        self.behind = [True] * len(self.bounds)
        if self._flight is not None:
            await self._finish()
        fragment = self.due(self.steps)
        if fragment is not None:
            self._start(fragment)
            if not self.overlap:
                await self._finish()

    async def finish(self) -> None:
        """End the round early: finish the exchange in flight, then sync every fragment
        that moved since its last sync (in index order), so every replica holds the
        global parameters (for evaluation, or the end of training)."""
        if self._flight is not None:
            await self._finish()
        for fragment, behind in enumerate(self.behind):
            if behind:
                self._start(fragment)
                await self._finish()

    def _start(self, fragment: int) -> None:
        lo, hi = self.bounds[fragment]
        sent = self._read(lo, hi)
        delta = self.global_params[lo:hi] - sent
        if self.bits is None:
            payload = delta
            pending = self.group.all_reduce(delta)
        else:
            payload = blocks.encode(delta, self._layout(hi - lo))
            pending = self.group.all_gather(payload.reshape(1, -1))
        self.sent_bytes += payload.nbytes
        self.largest_sent = max(self.largest_sent, payload.nbytes)
        self._flight = _Flight(fragment, self.steps, sent, pending.start(), None)

    async def _received(self) -> np.ndarray:
        flight = self._flight
        assert flight is not None
        if flight.summed is not None:
            return flight.summed
        assert flight.work is not None
        got = await flight.work.wait()
        if self.bits is None:
            return got
        lo, hi = self.bounds[flight.fragment]
        return blocks.decode_sum(got, self._layout(hi - lo))

    async def _finish(self) -> None:
        flight = self._flight
        assert flight is not None
        summed = await self._received()
        lo, hi = self.bounds[flight.fragment]
        average = (summed / self.group.size).astype(self.dtype)
        theta = self.global_params[lo:hi]
        self.outer[flight.fragment].step([theta], [average])
        learnt = flight.started < self.steps  # inner steps ran while the exchange did
        if learnt:  # overlap: keep what this replica learnt meanwhile
            fresh = theta + (self._read(lo, hi) - flight.sent)
        else:
            fresh = theta
        await self._write(lo, hi, fresh)
        self.behind[flight.fragment] = learnt
        self._flight = None

    # ---- checkpoints --------------------------------------------------------------------

    async def state_dict(self) -> dict[str, Any]:
        """The outer state; an exchange in flight is received (not applied) first."""
        state: dict[str, Any] = {
            "steps": self.steps,
            "behind": list(self.behind),
            "global": self.global_params.copy(),
            "outer": [_copied(o.state_dict()) for o in self.outer],
            "flight": None,
        }
        if self._flight is not None:
            summed = await self._received()
            self._flight = self._flight._replace(work=None, summed=summed)
            state["flight"] = {
                "fragment": self._flight.fragment,
                "started": self._flight.started,
                "sent": self._flight.sent.copy(),
                "summed": summed.copy(),
            }
        return state

    async def save(self, path: str | Path) -> None:
        """Write the outer state to ``path`` (safetensors, atomically)."""
        outer_state.write(path, await self.state_dict())

    def load(self, path: str | Path) -> None:
        """Adopt the outer state :meth:`save` wrote to ``path``."""
        self.load_state_dict(outer_state.read(path))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a state from :meth:`state_dict` (same model, group size and fragments);
        the model's own parameters are restored by its checkpoint, not here."""
        if self._flight is not None:
            raise InvalidState("cannot load DiLoCo state while an exchange is in flight")
        glob = np.asarray(state["global"])
        if glob.shape != self.global_params.shape or len(state["outer"]) != len(self.outer):
            raise InvalidArgument(
                f"DiLoCo state is for {glob.size} parameters in {len(state['outer'])} "
                f"fragments; this model has {self.global_params.size} in {len(self.outer)}"
            )
        self.steps = int(state["steps"])
        self.behind = [bool(b) for b in state["behind"]]
        self.global_params = glob.astype(self.dtype, copy=True)
        for outer, saved in zip(self.outer, state["outer"], strict=True):
            outer.load_state_dict(saved)
        flight = state.get("flight")
        if flight is not None:
            sent = flight.get("sent")
            if sent is None:  # a peer copy's, of the step it started after (the model's now)
                if int(flight["started"]) != self.steps:
                    raise InvalidArgument("a DiLoCo exchange's sent values are missing")
                sent = self._read(*self.bounds[int(flight["fragment"])])
            self._flight = _Flight(
                int(flight["fragment"]),
                int(flight["started"]),
                np.array(sent),
                None,
                np.array(flight["summed"]),
            )


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "steps": state["steps"],
        "state": [{k: v.copy() for k, v in s.items()} for s in state["state"]],
    }


def replica_groups(pg: ProcessGroup, replicas: int) -> tuple[Group, Group]:
    """(inner group, outer group) for ``replicas`` replicas of consecutive ranks: the
    ranks of this rank's replica, and the ranks holding the same place in every replica."""
    if replicas < 1 or pg.world_size % replicas:
        raise InvalidArgument(
            f"{replicas} DiLoCo replicas do not divide the {pg.world_size} ranks evenly"
        )
    size = pg.world_size // replicas
    return pg.node_group(local_world_size=size), pg.cross_node_group(local_world_size=size)


def replica_rows(
    batch: int, *, replica: int, replicas: int, rank: int, size: int
) -> tuple[np.ndarray, int]:
    """A global batch of ``batch`` rows split over ``replicas`` replicas of ``size`` data
    ranks each: the rows this rank (``rank`` within its replica) takes, and how many its
    replica takes (the count its loss is the mean over)."""
    parts = np.array_split(np.arange(batch), replicas * size)
    first = replica * size
    return parts[first + rank], sum(len(p) for p in parts[first : first + size])


def _cuts(
    fragments: int, sizes: list[int], places: Callable[[], tuple[list[int], int]] | None
) -> list[int]:
    """Where the fragments of the flat vector of ``sizes`` begin and end: even cuts of
    it, or, for a model that gives ``places()`` (where each of its arrays begins in the
    whole model's flat vector, and that vector's size), even cuts of the whole model,
    each at the local elements before it (the local order follows the whole's, so every
    fragment is still one contiguous run of local elements)."""
    total = sum(sizes)
    if places is None:
        return [int(c) for c in np.linspace(0, total, fragments + 1).round()]
    starts, whole = places()
    cuts = np.linspace(0, whole, fragments + 1).round().astype(int)
    return [
        sum(min(max(int(c) - start, 0), size) for start, size in zip(starts, sizes, strict=True))
        for c in cuts
    ]
