"""A group of ranks that runs collectives: validation, sequence numbers, deadlines,
poisoning, the flight recorder, and :class:`Pending`/:class:`Work` handles.

Each method checks its arguments and builds a frozen op descriptor
(``backends.ops``) that the group hands to its *backend*,
chosen once from the roster (``collectives.roster``): links, the node arena, or tiers
over nodes. The backend decides the algorithm (a ``Decision``, shown by the flight
recorder, the trace and :attr:`Pending.decision`) and moves the bytes.

Every call gets the next sequence number of its group when it is made, so calls made in
the same order on every rank line up even when they run concurrently. A call that fails
(timeout, mismatch, cancellation, dead peer) poisons the group: the error is relayed to
the other members, and every later call raises it (``collectives.calls``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from shardwire.protocol import TransportClosed
from shardwire.worker.backends import ops
from shardwire.worker.backends.base import Backend
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.ops import Op
from shardwire.worker.collectives import p2p, roster
from shardwire.worker.collectives.calls import Calls
from shardwire.worker.collectives.roster import DEFAULT_TIMEOUT
from shardwire.worker.collectives.work import Pending, Work
from shardwire.worker.kernels.reduce import ReduceOp
from shardwire.worker.kernels.scratch import ScratchPool
from shardwire.worker.observe import trace
from shardwire.worker.observe.flight import FlightRecorder
from shardwire.worker.observe.split import Split
from shardwire.worker.transport.base import Transport

T = TypeVar("T")


class Group:
    """Collectives over a set of ranks: ``ranks`` are its members' global ranks, this
    process is group rank ``rank`` of ``size``.

    ``backend`` asks for one backend (``links``, ``arena`` or ``tiered``) instead of the
    one the roster picks; ``algorithms`` pins the links backend's algorithm per op
    (``{"all_reduce": "ring"}``). Every member must ask alike (it is part of every
    call's signature, so members that differ fail as a mismatch).
    """

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int] | None = None,
        *,
        group_id: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        recorder: FlightRecorder | None = None,
        backend: str | None = None,
        algorithms: Mapping[str, str] | None = None,
    ):
        members = roster.members(transport, ranks, group_id)
        self.transport = transport
        self.ranks = members
        self.rank = members.index(transport.rank)
        self.size = len(members)
        self.group_id = group_id
        self.timeout = timeout
        self.choice = roster.Choice.of(backend, algorithms)
        self._asked = self.choice.asked  # read on every call
        # the call of the parent group that this subgroup's calls are phases of, if any:
        # part of their signatures, so a mismatch names the calls the user made
        self.within = ""
        self._seq = 0
        self._works: set[Work] = set()
        self.pool = ScratchPool()  # scratch buffers its calls reuse (hits, misses)
        self._children: list[Group] = []  # subgroups this group created and closes
        self._closed = False
        self._backend: Backend | None = None
        self._calls = Calls(self)
        # Recent calls of this group and its subgroups, for hang diagnosis.
        self.recorder = recorder or FlightRecorder()
        transport.groups.add(self)  # unique per transport while the group lives

    # ---- the backend, subgroups, lifecycle ---------------------------------------------

    @property
    def backend(self) -> Backend:
        """How this group's calls move their bytes, chosen from the roster on first use
        (links until the transport knows which node every rank is on)."""
        backend = self._backend
        if backend is None:
            backend, known = roster.backend_for(self)
            if known:
                self._backend = backend
        return backend

    def new_group(
        self,
        ranks: Sequence[int],
        *,
        name: str = "",
        timeout: float | None = None,
        backend: str | None = None,
        algorithms: Mapping[str, str] | None = None,
    ) -> Group:
        """A subgroup; only its members call this. ``name`` tells apart groups with the
        same members. Each group has its own tag space, so groups run concurrently.

        Asking again for a group that is still open (same members and name) returns that
        group. This group owns the subgroup: :meth:`aclose` closes it too."""
        global_ranks = [self.ranks[r] for r in ranks]
        group_id, live = roster.open_group(self.transport, global_ranks, name, Group)
        if live is not None:
            return live
        group = Group(
            self.transport,
            global_ranks,
            group_id=group_id,
            timeout=self.timeout if timeout is None else timeout,
            recorder=self.recorder,
            backend=backend,
            algorithms=algorithms,
        )
        self._children.append(group)
        return group

    @property
    def error(self) -> BaseException | None:
        """The error that poisoned this group, if any."""
        return self._calls.error

    @property
    def expiring(self) -> BaseException | None:
        """The error of the parent call whose deadline cancels this subgroup's calls."""
        return self._calls.expiring

    @expiring.setter
    def expiring(self, error: BaseException | None) -> None:
        self._calls.expiring = error

    def failed_now(self) -> BaseException | None:
        """The error this group failed with, or that a peer ended a call under way with;
        else the error its transport was poisoned with: whatever makes its next call
        raise (:meth:`_check`)."""
        return (
            self._calls.failed_now()
            or self.transport.group_error(self.group_id)
            or self.transport.error
        )

    def silent_now(self) -> list[int]:
        """Global ranks the calls under way are waiting for."""
        return self._calls.silent_now()

    def fail(self, error: BaseException) -> None:
        """Poison this group with ``error`` from outside its calls (a call of a group it
        works with failed): its members are told, and its backend woken."""
        self._calls.poison(error)
        if self._backend is not None and self._calls.error is not None:
            self._backend.poison(self._calls.error)

    def transport_aborted(self, error: BaseException) -> None:
        """The transport under this group was poisoned: wake its backend."""
        if self._backend is not None:
            self._backend.poison(error)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Work[T]:
        """Run ``coro`` (a sequence of this group's calls) in the background, owned by
        the group like a started call: :meth:`aclose` cancels it."""
        task = asyncio.ensure_future(coro)
        work = Work(task)
        self._works.add(work)
        task.add_done_callback(lambda _t: self._works.discard(work))
        return work

    async def aclose(self) -> None:
        """Cancel and await every collective still running on this group, then close the
        subgroups it created (its calls may be running theirs: a tiered call's phases);
        later calls raise. Safe to call again, also after a close that was itself
        cancelled (which propagates; the calls' own errors end here)."""
        self._closed = True
        works = list(self._works)
        for work in works:
            work.cancel()
        await asyncio.gather(*(work.ended() for work in works))
        for child in self._children:
            await child.aclose()
        if self._backend is not None:
            self._backend.close()
        self._calls.deadlines.close()
        self.pool.clear()
        self.transport.groups.remove(self)

    # ---- making a call -----------------------------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise TransportClosed(f"group {self.group_id} (ranks {list(self.ranks)}) is closed")
        calls = self._calls
        if calls.error is None:
            calls.error = self.transport.group_error(self.group_id)
        if calls.error is not None:
            raise calls.error
        if self.transport.error is not None:
            raise self.transport.error

    def _start(self, op: Op, timeout: float | None) -> Pending[Any]:
        """Number the call, let the backend decide and place it, and return its handle."""
        self._check()
        self._seq += 1
        seq = self._seq
        backend = self._backend or self.backend
        decision = backend.decide(op)
        kind = ops.kind(op)
        signature = op.signature + self.choice.mark(kind) if self._asked else op.signature
        if type(op) in ops.SIGNS_DECISION:
            signature = f"{signature}:{decision.algorithm}"
        if self.within:
            signature = f"{signature} in {self.within}"
        limit = self.timeout if timeout is None else timeout
        split = None
        if trace.current() is not None:  # traced: where time goes
            split = Split()
            split.algorithm = decision.algorithm
        start = self.recorder.clock()
        if backend.express(op, seq, signature, limit, split):
            self.recorder.ended(
                group=self.group_id,
                ranks=self.ranks,
                op=kind,
                seq=seq,
                nbytes=op.nbytes,
                start=start,
                split=split,
                path=decision.backend,
            )
            return Pending(self, None, value=op.result, decision=decision)
        call = Call(
            self.transport,
            self.ranks,
            self.rank,
            self.group_id,
            seq,
            signature,
            self.pool,
            split=split,
        )
        launch = backend.launch(op, call, decision, limit)
        run = self._calls.run(
            call, launch.run, limit, op.nbytes, decision=decision, backend=backend
        )
        return Pending(self, run, launch.hurry, decision=decision)

    # ---- reductions --------------------------------------------------------------------

    def all_reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Reduce ``x`` over the group; in place unless ``out`` is given. Returns it."""
        return self._start(ops.AllReduce.of(x, op, out), timeout)

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Reduce ``x`` (all chunks) over the group; rank r gets chunk r of axis 0.
        Chunks are equal (``len(x)`` divisible by the group size) or ``sizes``."""
        request = ops.ReduceScatter.of(x, op, sizes, out, size=self.size, rank=self.rank)
        return self._start(request, timeout)

    def reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        root: int = 0,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray | None]:
        """Reduce ``x`` onto ``root``: root returns the result (in ``x`` unless ``out``);
        the others return None and keep ``x`` unchanged."""
        return self._start(ops.Reduce.of(x, op, root, out, size=self.size), timeout)

    def scan(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Rank r gets the reduction of ranks 0..r's ``x`` (an inclusive prefix
        reduction, as ``MPI_Scan``; AVG divides by r + 1); in place unless ``out`` is
        given. Returns it."""
        return self._start(ops.Scan.of(x, op, out), timeout)

    # ---- data movement -----------------------------------------------------------------

    def all_gather(
        self,
        x: np.ndarray,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Concatenate every rank's ``x`` along axis 0 (rank order). First dimensions
        are equal, or given for every rank in ``sizes``."""
        return self._start(ops.AllGather.of(x, sizes, out, size=self.size, rank=self.rank), timeout)

    def broadcast(
        self, x: np.ndarray, *, root: int = 0, timeout: float | None = None
    ) -> Pending[np.ndarray]:
        """Overwrite ``x`` on every rank with root's ``x`` (same shape and dtype)."""
        return self._start(ops.Broadcast.of(x, root, size=self.size), timeout)

    def gather(
        self,
        x: np.ndarray,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray | None]:
        """Concatenate every rank's ``x`` along axis 0 on ``root`` (others get None)."""
        request = ops.Gather.of(x, root, sizes, out, size=self.size, rank=self.rank)
        return self._start(request, timeout)

    def scatter(
        self,
        x: np.ndarray | None,
        *,
        root: int = 0,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Root splits ``x`` along axis 0 (equal chunks or ``sizes``); rank r gets chunk r.
        Non-roots pass ``None`` (or an ``out`` array of their chunk's shape)."""
        request = ops.Scatter.of(x, root, sizes, out, size=self.size, rank=self.rank)
        return self._start(request, timeout)

    def all_to_all(
        self,
        x: np.ndarray,
        *,
        send_splits: Sequence[int] | None = None,
        recv_splits: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Send part p of ``x`` (axis 0, equal or ``send_splits``) to rank p; return the
        parts received, concatenated in rank order (into a buffer of ``recv_splits``
        rows each, when given).

        Above 8 ranks a call without ``recv_splits`` runs Bruck's algorithm: each rank
        talks to about log2 n others and a block crosses about log2(n)/2 links, which
        suits small blocks (counts, metadata). With ``recv_splits`` every block goes
        straight to its rank, as large exchanges should. Every rank of a call must give
        ``recv_splits`` or none must."""
        request = ops.AllToAll.of(x, send_splits, recv_splits, size=self.size)
        return self._start(request, timeout)

    def barrier(self, *, timeout: float | None = None) -> Pending[None]:
        """Return once every member has entered the barrier."""
        return self._start(_BARRIER, timeout)

    def broadcast_object(
        self, obj: Any = None, *, root: int = 0, timeout: float | None = None
    ) -> Pending[Any]:
        """Root's small msgpack-able value, on every rank."""
        return self._start(self._objects(obj, "broadcast", root), timeout)

    def all_gather_object(self, obj: Any, *, timeout: float | None = None) -> Pending[list[Any]]:
        """Every rank's small msgpack-able value, as a list in rank order."""
        return self._start(self._objects(obj, "all", 0), timeout)

    def gather_object(
        self, obj: Any, *, root: int = 0, timeout: float | None = None
    ) -> Pending[list[Any] | None]:
        """Every rank's small msgpack-able value, as a list in rank order on ``root``
        (None elsewhere): the bytes grow with the group, not with its square; above 8
        ranks they go up a binomial tree, so each rank talks to about log2 n others."""
        return self._start(self._objects(obj, "gather", root), timeout)

    def _objects(self, obj: Any, mode: str, root: int) -> ops.Objects:
        return ops.Objects.of(obj, mode, root, size=self.size, rank=self.rank)

    # ---- point to point ----------------------------------------------------------------

    def send(
        self, x: np.ndarray, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> Pending[None]:
        """Send ``x`` to group rank ``dst``; ends when ``x`` may be reused."""
        return p2p.send(self, x, dst, tag, self.timeout if timeout is None else timeout)

    def recv(
        self, src: int, *, tag: int = 0, out: np.ndarray | None = None, timeout: float | None = None
    ) -> Pending[np.ndarray]:
        """Receive the next message with ``tag`` from group rank ``src``."""
        return p2p.recv(self, src, tag, out, self.timeout if timeout is None else timeout)

    def recv_any(
        self, *, tag: int = 0, out: np.ndarray | None = None, timeout: float | None = None
    ) -> Pending[tuple[int, np.ndarray]]:
        """Receive the next message with ``tag`` from any rank of the group: (its group
        rank, the array). A receive naming its source is served first."""
        return p2p.recv_any(self, tag, out, self.timeout if timeout is None else timeout)


_BARRIER = ops.Barrier()
