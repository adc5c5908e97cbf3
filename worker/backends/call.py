"""One collective call's view of the group: who is where, and its tag space."""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from shardwire.protocol import Tag
from shardwire.worker.kernels.reduce import ReduceOp
from shardwire.worker.kernels.scratch import ScratchPool
from shardwire.worker.observe.split import Split, reduce_with
from shardwire.worker.transport.base import Fold, Receive, Transport

# No transport-level timer: the call's own deadline (the group timeout) bounds every
# wait and turns into CollectiveTimeout with the ranks not heard from. One timer per call
# instead of one per message.
_UNTIMED = math.inf


@dataclass(frozen=True, slots=True)
class Call:
    """Messages of one call share (group id, seq) and carry its signature as the op."""

    transport: Transport
    ranks: tuple[int, ...]  # group rank -> global rank
    rank: int  # this process's group rank
    group_id: int
    seq: int
    signature: str
    pool: ScratchPool = field(default_factory=ScratchPool)
    receives: list[Receive] = field(default_factory=list)  # for "not heard from" reports
    taken: list[np.ndarray] = field(default_factory=list)  # scratch to give back
    step_base: int = 0  # added to every step: keeps a sub-call's messages apart
    stalled: list[int] = field(default_factory=list)  # ranks a node-arena wait gave up on
    # who a wait outside the receives (the node arena) waits for now, asked on the loop
    probes: list[Callable[[], list[int]]] = field(default_factory=list)
    # a peer's error that ended a wait outside the receives and was not delivered yet
    failures: list[Callable[[], BaseException | None]] = field(default_factory=list)
    split: Split | None = None  # where the call's time goes (traced jobs only)

    def sub(self, members: Sequence[int], step_base: int = 0) -> Call:
        """The same call seen by a subset of its ranks (group ranks ``members``, in that
        order), with steps offset by ``step_base``; it shares this call's scratch and
        receive bookkeeping."""
        return replace(
            self,
            ranks=tuple(self.ranks[m] for m in members),
            rank=list(members).index(self.rank),
            step_base=self.step_base + step_base,
        )

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A flat buffer that lives until the call ends (reused across calls)."""
        array = self.pool.take(count, dtype)
        self.taken.append(array)
        return array

    @property
    def size(self) -> int:
        return len(self.ranks)

    def tag(self, step: int) -> Tag:
        return Tag(self.group_id, self.seq, self.step_base + step)

    def send(self, peer: int, array: np.ndarray, step: int) -> Coroutine[Any, Any, None]:
        # The transport's coroutine itself, not one wrapping it: one frame less per send.
        sending = self.transport.send(
            self.ranks[peer],
            array,
            tag=Tag(self.group_id, self.seq, self.step_base + step),
            op=self.signature,
            timeout=_UNTIMED,
        )
        return sending if self.split is None else self._noted(sending, peer, array.nbytes)

    async def _noted(self, sending: Coroutine[Any, Any, None], peer: int, nbytes: int) -> None:
        """A traced call's send: its path is noted in the split."""
        await sending
        assert self.split is not None
        self.split.paths.add(self.transport.path_to(self.ranks[peer], nbytes))

    def irecv(
        self, peer: int, step: int, out: np.ndarray | None = None, fold: Fold | None = None
    ) -> Receive:
        receive = self.transport.irecv(
            self.ranks[peer],
            tag=Tag(self.group_id, self.seq, self.step_base + step),
            op=self.signature,
            out=out,
            timeout=_UNTIMED,
            fold=fold,
        )
        self.receives.append(receive)
        return receive

    def combine(self, op: ReduceOp, first: np.ndarray, second: np.ndarray, *, out: np.ndarray):
        """``out = first (op) second`` (:func:`~shardwire.worker.kernels.reduce.combine`),
        timed when the job is traced."""
        reduce_with(self.split, op, first, second, out)

    def waits(self) -> None:
        """Add the time this call's receives waited for their payloads to its split."""
        split = self.split
        if split is None:
            return
        for receive in self.receives:
            began = receive.began
            if receive.awaited_at and began > receive.awaited_at:
                split.waited(receive.awaited_at, began)

    def silent_ranks(self) -> list[int]:
        """Global ranks this call is still waiting for."""
        silent = {r.src for r in self.receives if not r.received} | set(self.stalled)
        for probe in self.probes:
            silent.update(probe())
        return sorted(silent)

    def recv(
        self, peer: int, step: int, out: np.ndarray | None = None
    ) -> Coroutine[Any, Any, np.ndarray]:
        return self.irecv(peer, step, out).wait()
