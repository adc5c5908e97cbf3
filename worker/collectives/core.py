"""A group of ranks that runs collectives: sequence numbers, deadlines, poisoning, handles.

Every call gets the next sequence number of its group at the moment it is made, so calls
made in the same order on every rank line up even when they run concurrently. A call
that fails (timeout, mismatch, cancellation, dead peer) poisons the group: the error is
relayed to the other members, and every later call raises it.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from shardwire.protocol import (
    CollectiveCancelled,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    IntegrityError,
    MessageMismatch,
    ShardwireError,
    TransportClosed,
)
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.arena.gate import Gate, Ticket
from shardwire.worker.arena.programs import Context, Program
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.deadlines import Deadlines
from shardwire.worker.collectives.layout import node_layout
from shardwire.worker.collectives.scratch import ScratchPool
from shardwire.worker.collectives.split import Split
from shardwire.worker.collectives.waits import WAITS
from shardwire.worker.collectives.work import Pending, Work
from shardwire.worker.runtime import trace
from shardwire.worker.runtime.flight import FlightRecorder
from shardwire.worker.transport.base import Transport
from shardwire.worker.transport.receive import TransportTimeout

T = TypeVar("T")
DEFAULT_TIMEOUT = 300.0
# Arena calls of at most this many bytes run when they are made, if the arena is idle
# (``Gate.express``); larger ones run when awaited, or on the arena's thread once started.
EXPRESS_BYTES = 64 * 1024
# An arena-capable call: the program to run on the node arena, and the call's result then.
ArenaPlan = tuple[Callable[[Context], Program], Any]


def group_id_for(ranks: Sequence[int], name: str = "") -> int:
    """A group id every member derives alike from the member list (0 is the world)."""
    text = f"{name}|{','.join(map(str, ranks))}"
    return (zlib.crc32(text.encode()) & 0x3FFFFFFF) + 1


class GroupCore:
    """Membership, sequencing and failure handling shared by all collectives."""

    def __init__(
        self,
        transport: Transport,
        ranks: Sequence[int] | None = None,
        *,
        group_id: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        recorder: FlightRecorder | None = None,
    ):
        members = tuple(range(transport.world_size)) if ranks is None else tuple(ranks)
        if len(set(members)) != len(members) or not members:
            raise InvalidArgument(
                f"group ranks must be distinct and non-empty, got {list(members)}"
            )
        if transport.rank not in members:
            raise InvalidArgument(f"rank {transport.rank} is not a member of group {list(members)}")
        live = transport.groups.get(group_id)
        if live is not None:
            raise InvalidArgument(
                f"group id {group_id} is already used on rank {transport.rank} by group "
                f"{list(live.ranks)}; close that group first"
            )
        self.transport = transport
        self.ranks = members
        self.rank = members.index(transport.rank)
        self.size = len(members)
        self.group_id = group_id
        self.timeout = timeout
        self._seq = 0
        self._error: BaseException | None = None
        self._works: set[Work] = set()
        self.pool = ScratchPool()  # scratch buffers its calls reuse (hits, misses)
        self._deadlines = Deadlines()
        self._children: list[GroupCore] = []  # subgroups this group created and closes
        self._closed = False
        self._layout: list[list[int]] | None = None
        self._layout_known = False  # the transport knows the nodes once it has a roster
        self._gate: Gate | None = None
        self._gate_known = False
        self._live: dict[int, Call] = {}  # calls under way, by sequence number
        self._tiers: Any = None  # a Group's node and lane subgroups (collectives.tiers)
        # the call of the parent group that this subgroup's calls are phases of, if any:
        # part of their signatures, so a mismatch names the calls the user made
        self.within = ""
        # the error of the parent's call whose deadline is cancelling this group's calls:
        # what they tell their peers instead of "cancelled"
        self.expiring: BaseException | None = None
        self._expired: dict[int, BaseException] = {}  # why calls passed their deadlines
        # Recent calls of this group and its subgroups, for hang diagnosis.
        self.recorder = recorder or FlightRecorder()
        transport.groups.add(self)  # unique per transport while the group lives

    @property
    def layout(self) -> list[list[int]] | None:
        """This group's ranks (group ranks) by node, when the hierarchical algorithms
        apply (several nodes, one of them with two ranks or more); else None."""
        if not self._layout_known:
            nodes = self.transport.topology.nodes
            self._layout = node_layout([nodes[r] for r in self.ranks]) if nodes else None
            self._layout_known = nodes is not None
        return self._layout

    @property
    def gate(self) -> Gate | None:
        """The way into this group's node arena, when all its ranks share this node and
        the transport allows arenas (else None: the group moves data by messages)."""
        if not self._gate_known:
            topology = self.transport.topology
            nodes, settings = topology.nodes, topology.arena
            if nodes is not None:
                self._gate_known = True
                mine = nodes[self.transport.rank]
                if (
                    settings is not None
                    and self.size > 1
                    and all(nodes[r] == mine for r in self.ranks)
                ):
                    what = f"rank {self.transport.rank}, group {self.group_id}"
                    self._gate = Gate(settings, self.spawn, what, self.transport.stats)
        return self._gate

    @property
    def error(self) -> BaseException | None:
        """The error that poisoned this group, if any."""
        return self._error

    def _check(self) -> None:
        if self._closed:
            raise TransportClosed(f"group {self.group_id} (ranks {list(self.ranks)}) is closed")
        if self._error is None:
            self._error = self.transport.group_error(self.group_id)
        if self._error is not None:
            raise self._error
        if self.transport.error is not None:
            raise self.transport.error

    def _start(
        self,
        signature: str,
        algorithm: Callable[[Call], Awaitable[T]],
        *,
        timeout: float | None,
        nbytes: int = 0,
        arena: ArenaPlan | None = None,
    ) -> Pending[T]:
        self._check()
        self._seq += 1
        if self.within:
            signature = f"{signature} in {self.within}"
        limit = self.timeout if timeout is None else timeout
        gate = self.gate if arena is not None else None
        ticket: Ticket | bool = False
        split = Split() if trace.current() is not None else None  # traced: where time goes
        if gate is not None and arena is not None and nbytes <= EXPRESS_BYTES:
            start = self.recorder.clock()
            with WAITS:  # it runs here, to its end when the engine is idle
                ticket = gate.express(self._seq, signature, arena[0], limit, split)
            if ticket is True:
                op = signature[: signature.find(":")]
                self.recorder.ended(
                    group=self.group_id,
                    ranks=self.ranks,
                    op=op,
                    seq=self._seq,
                    nbytes=nbytes,
                    start=start,
                    split=split,
                )
                return Pending(self, None, value=arena[1])
        call = Call(
            self.transport,
            self.ranks,
            self.rank,
            self.group_id,
            self._seq,
            signature,
            self.pool,
            split=split,
        )
        if gate is None or arena is None:
            return Pending(self, self._run(call, algorithm, limit, nbytes, "links"))
        build, result = arena  # queued now: the arena runs calls in order
        if not isinstance(ticket, Ticket):
            ticket = gate.enqueue(call, build, limit)
        tcp = algorithm

        async def on_arena(c: Call) -> T:
            c.probes.append(lambda: gate.waiting(ticket))
            c.failures.append(lambda: gate.relayed(ticket))
            if await gate.run(ticket, c.stalled):
                return result
            return await tcp(c)

        work = self._run(call, on_arena, limit, nbytes, "arena")
        return Pending(self, work, lambda: gate.hurry(ticket))

    def spawn(self, coro: Coroutine[Any, Any, T]) -> Work[T]:
        """Run ``coro`` (a sequence of this group's calls) in the background, owned by
        the group like a started call: :meth:`aclose` cancels it."""
        task = asyncio.ensure_future(coro)
        work = Work(task)
        self._works.add(work)
        task.add_done_callback(lambda _t: self._works.discard(work))
        return work

    async def _run(
        self,
        call: Call,
        algorithm: Callable[[Call], Awaitable[T]],
        limit: float,
        nbytes: int,
        path: str,
    ) -> T:
        op = call.signature.split(":", 1)[0]
        what = f"{op} #{call.seq}"
        me = self.transport.rank
        entry = self.recorder.begin(
            group=self.group_id,
            ranks=self.ranks,
            op=op,
            seq=call.seq,
            nbytes=nbytes,
            pending=call.silent_ranks,
            path=path,
        )
        outcome, expired = "error", False
        self._deadlines.watch(call.seq, limit, lambda: self._expire(call, what, limit))
        self._live[call.seq] = call
        try:
            try:
                result = await algorithm(call)
            finally:
                expired = self._deadlines.release(call.seq)
                del self._live[call.seq]
                timed_out = self._expired.pop(call.seq, None)
            self.pool.give(call.taken)
            outcome = "ok"
            return result
        except (TimeoutError, TransportTimeout, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not expired:
                outcome = "cancelled"
                self._poison(
                    self.expiring or CollectiveCancelled(f"{what} was cancelled on rank {me}")
                )
                raise
            outcome = "timeout"
            self._poison(timed_out or self._timed_out(call, what, limit))
        except IntegrityError as exc:  # seen here first when not relayed
            if exc.peer >= 0:
                self._poison(exc)
            self._error = self._error or exc
        except CollectiveError as exc:  # relayed by a peer that failed first
            self._error = self._error or exc
        except MessageMismatch as exc:
            self._poison(CollectiveMismatch(f"{what} on rank {me}: {exc}"))
        except (ShardwireError, OSError) as exc:  # PeerFailed, JobAborted, closed
            self._error = self._error or exc
        finally:
            if outcome == "error":
                outcome = f"error: {type(self._error).__name__}"
            silent = call.silent_ranks() if outcome != "ok" else ()  # the hot path skips it
            call.waits()
            self.recorder.end(entry, outcome, silent=silent, split=call.split)
            if outcome != "ok" and self._gate is not None and self._error is not None:
                self._gate.poison(self._error)  # wakes the ranks of this node at once
        assert self._error is not None
        raise self._error

    def _subgroups(self) -> list[GroupCore]:
        """The subgroups this group's hierarchical calls run their phases in."""
        return [] if self._tiers is None else self._tiers.subgroups()

    def _silent_inside(self) -> list[int]:
        """Global ranks the calls of this group's hierarchical subgroups wait for."""
        return [r for g in self._subgroups() for r in g.silent_now()]

    def _expire(self, call: Call, what: str, limit: float) -> None:
        """``call`` passed its deadline: note why before the cancellation unwinds the
        calls of subgroups, and have those tell their peers the same."""
        call.stalled.extend(self._silent_inside())
        error = self._expired[call.seq] = self._timed_out(call, what, limit)
        for group in self._subgroups():
            group.expiring = error

    def _timed_out(self, call: Call, what: str, limit: float) -> BaseException:
        """Why ``call`` did not end in time: the ranks it waits for; else the error a
        peer ended one of its phases with that had not reached it yet."""
        waiting = call.silent_ranks()
        if not waiting:
            relayed = _failure(call) or next(
                (e for g in (self, *self._subgroups()) if (e := g.failed_now())), None
            )
            if relayed is not None:
                return relayed
        heard = f"not heard from ranks {waiting}" if waiting else "stuck sending"
        me = self.transport.rank
        return CollectiveTimeout(f"{what} timed out after {limit:g} s on rank {me}: {heard}")

    def failed_now(self) -> BaseException | None:
        """The error this group failed with, or that a peer ended a call under way with."""
        if self._error is not None:
            return self._error
        return next((e for call in self._live.values() if (e := _failure(call))), None)

    def silent_now(self) -> list[int]:
        """Global ranks the calls under way are waiting for."""
        return sorted({r for call in self._live.values() for r in call.silent_ranks()})

    def fail(self, error: BaseException) -> None:
        """Poison this group with ``error`` from outside its calls (a call of a group it
        works with failed): its members are told, and its node arena is woken."""
        self._poison(error)
        if self._gate is not None and self._error is not None:
            self._gate.poison(self._error)

    def _poison(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        with contextlib.suppress(TransportClosed):
            self.transport.poison_group(self.group_id, self._error, self.ranks)

    def transport_aborted(self, error: BaseException) -> None:
        """The transport under this group was poisoned: wake its node arena."""
        if self._gate is not None:
            self._gate.poison(error)

    def _adopt(self, child: GroupCore) -> None:
        self._children.append(child)

    async def aclose(self) -> None:
        """Close the subgroups this group created, then cancel and await every collective
        still running on it; later calls raise. Safe to call again, also after a close
        that was itself cancelled (which propagates; the calls' own errors end here)."""
        self._closed = True
        for child in self._children:
            await child.aclose()
        works = list(self._works)
        for work in works:
            work.cancel()
        await asyncio.gather(*(work.ended() for work in works))
        if self._gate is not None:
            self._gate.close()
        self._deadlines.close()
        self.pool.clear()
        self.transport.groups.remove(self)


def _failure(call: Call) -> BaseException | None:
    """The error a peer ended a wait of ``call`` with that had not reached it yet."""
    return next((e for f in call.failures if (e := f()) is not None), None)
