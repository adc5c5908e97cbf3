"""The arena backend: a group whose ranks all share this node moves its data through the
node arena (``worker.arena``), and over its links where the arena cannot serve.

all_reduce, scan, reduce_scatter, all_gather, broadcast and barrier run as arena programs
(``arena.programs``); the other ops, and every op while the arena cannot be made (no
room in ``/dev/shm``, no atomics), run on the links backend. A call is queued with the
arena when it is *made* (``Gate.enqueue``), so the arena runs a group's calls in call
order however the caller awaits them. A call of at most ``EXPRESS_BYTES`` made while the
arena is idle runs at once, on the loop, to its end when its peers are there
(``Gate.express``): no task, future or thread hop.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from shardwire.worker.arena import programs
from shardwire.worker.arena.programs import Context, Program
from shardwire.worker.backends.algorithms import Algorithm
from shardwire.worker.backends.base import Backend, Decision, PlacedCall
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.gate import Gate, GateState, Ticket
from shardwire.worker.backends.ops import (
    AllGather,
    AllReduce,
    Barrier,
    Broadcast,
    Op,
    ReduceScatter,
    Scan,
)
from shardwire.worker.backends.peerlinks import LinksBackend
from shardwire.worker.observe.split import Split
from shardwire.worker.observe.waits import WAITS
from shardwire.worker.transport.arena_settings import ArenaSettings
from shardwire.worker.transport.traffic import TransportStats

# Calls of at most this many bytes run when they are made, if the arena is idle
# (``Gate.express``); larger ones run when awaited, or on the arena's thread once started.
EXPRESS_BYTES = 64 * 1024
_ARENA = Decision("arena", Algorithm.ARENA)
Build = Callable[[Context], Program]


def program(op: Op, size: int) -> Build | None:
    """The arena program of ``op`` in a group of ``size``; None if the arena has none."""
    make = _PROGRAMS.get(type(op))
    return None if make is None else make(op, size)


def _all_reduce(op: AllReduce, size: int) -> Build:
    return lambda ctx: programs.all_reduce(ctx, op.buf, op.op, size)


def _scan(op: Scan, size: int) -> Build:
    return lambda ctx: programs.scan(ctx, op.buf, op.op)


def _reduce_scatter(op: ReduceScatter, size: int) -> Build:
    return lambda ctx: programs.reduce_scatter(ctx, op.src, op.out, op.segs, op.op, count=size)


def _all_gather(op: AllGather, size: int) -> Build:
    parts = [op.buf[s:e] for s, e in op.segs]
    return lambda ctx: programs.all_gather(ctx, parts, op.src)


def _broadcast(op: Broadcast, size: int) -> Build:
    return lambda ctx: programs.broadcast(ctx, op.buf, op.root)


def _barrier(op: Barrier, size: int) -> Build:
    return programs.barrier


_PROGRAMS: dict[type, Callable[[Any, int], Build]] = {
    AllReduce: _all_reduce,
    Scan: _scan,
    ReduceScatter: _reduce_scatter,
    AllGather: _all_gather,
    Broadcast: _broadcast,
    Barrier: _barrier,
}


class ArenaBackend(Backend):
    """The node arena of a group on one node, and its links for the rest."""

    __slots__ = ("_handed", "gate", "links", "size")
    name = "arena"

    def __init__(
        self,
        links: LinksBackend,
        settings: ArenaSettings,
        spawn: Callable[[Coroutine[Any, Any, None]], Any],
        what: str,
        stats: TransportStats,
    ) -> None:
        self.links = links
        self.size = links.size
        self.gate = Gate(settings, spawn, what, stats)
        # what express built for call ``seq`` and did not finish (its ticket, when it
        # started it): launch takes it over instead of building the program again
        self._handed: tuple[int, Build, Ticket | None] | None = None

    def decide(self, op: Op) -> Decision:
        state = self.gate.state
        if state is GateState.UNAVAILABLE or type(op) not in _PROGRAMS:
            return self.links.decide(op)
        return _ARENA

    def express(self, op: Op, seq: int, signature: str, limit: float, split: Split | None) -> bool:
        if op.nbytes > EXPRESS_BYTES or self.gate.state is not GateState.OPEN:
            return False
        build = program(op, self.size)
        if build is None:
            return False
        with WAITS:  # it runs here, to its end when the engine is idle
            ticket = self.gate.express(seq, signature, build, limit, split)
        if ticket is True:
            return True
        self._handed = (seq, build, ticket if isinstance(ticket, Ticket) else None)
        return False

    def launch(self, op: Op, call: Call, decision: Decision, limit: float) -> PlacedCall:
        if decision is not _ARENA:
            return self.links.launch(op, call, decision, limit)
        handed, self._handed = self._handed, None
        if handed is not None and handed[0] == call.seq:
            _, build, started = handed
        else:
            built, started = program(op, self.size), None
            assert built is not None
            build = built
        ticket = started if started is not None else self.gate.enqueue(call, build, limit)
        gate, links = self.gate, self.links

        async def run(c: Call) -> Any:
            c.probes.append(lambda: gate.waiting(ticket))
            c.failures.append(lambda: gate.relayed(ticket))
            if await gate.run(ticket, c.stalled):
                return op.result
            # the arena could not be made: the links
            return await links.runner(op, links.decide(op).algorithm)(c)

        return PlacedCall(run, lambda: gate.hurry(ticket))

    def poison(self, error: BaseException) -> None:
        self.gate.poison(error)

    def close(self) -> None:
        self.gate.close()
