"""A group's node arena, attached: region, board, clocks and engine.

It is opened by the arena backend over the group's own messages
(``backends.opening``); from then on its calls run as programs on the engine.
"""

from __future__ import annotations

import asyncio
import errno
import os
import zlib
from collections.abc import Callable
from typing import Any

from shardwire.protocol import CollectiveError, JobAborted, MessageMismatch, PeerFailed
from shardwire.protocol.errors import origin_of, relayed_error
from shardwire.worker.arena.board import Board, Poisoned, Stalled
from shardwire.worker.arena.engine import Abandoned, Engine, Job
from shardwire.worker.arena.peerread import ReadFailed
from shardwire.worker.arena.programs import Clock, Context, HalfViews, Mismatch, Program
from shardwire.worker.arena.region import Region
from shardwire.worker.observe.split import Split
from shardwire.worker.transport.arena_settings import READS_SETTING, ArenaSettings


class ArenaTimeout(TimeoutError):
    """An arena wait passed its deadline (the group turns it into CollectiveTimeout)."""


class NodeArena:
    """One group's arena on this node, attached."""

    def __init__(
        self,
        region: Region,
        me: int,
        ranks: tuple[int, ...],
        settings: ArenaSettings,
        pids: list[int] | None = None,
    ):
        self.region = region
        self.ranks = ranks  # local index -> global rank
        self.rank = ranks[me]
        self.board = Board(region, me)
        g = region.geometry
        assert region.map is not None
        offsets = [[g.half(r, 0), g.half(r, 1)] for r in range(g.ranks)]
        self.halves = HalfViews(region.map, offsets, g.half_bytes)
        self.clock = Clock()
        self.context = Context(self.board, self.halves, self.clock, 0)
        self.context.pids = pids  # the ranks may read each other's memory (``peerread``)
        self._stamps: dict[str, int] = {}
        self._counted = (0, 0)
        self.engine = Engine(
            self.board,
            spin=settings.spin,
            yield_cpu=settings.yield_cpu,
            nap=settings.nap,
            name=f"arena-{ranks[me]}",
        )

    def submit(
        self,
        build: Callable[[Context], Program],
        seq: int,
        signature: str,
        deadline: float,
        split: Split | None = None,
    ) -> Job:
        """Queue a call's program (call order); its time is split into ``split``."""
        self.board.enter(seq)
        program = _deferred(build, self.context, self._stamp(seq, signature), split)
        return self.engine.submit(program, deadline, split, seq)

    def express(
        self,
        build: Callable[[Context], Program],
        seq: int,
        signature: str,
        deadline: float,
        split: Split | None = None,
    ) -> Job | None:
        """Run a call's program at once if the engine is idle (see ``Engine.express``);
        None if it is not, and nothing was done."""
        engine = self.engine
        if not engine.claim():
            return None
        self.board.enter(seq)
        context = self.context  # the engine is idle: this program runs first
        context.signature, context.split = self._stamp(seq, signature), split
        return engine.express(build(context), deadline, split, seq)

    def _stamp(self, seq: int, signature: str) -> int:
        """The call's signature word: its sequence number and a CRC of its signature."""
        crc = self._stamps.get(signature)
        if crc is None:
            if len(self._stamps) > 4096:
                self._stamps.clear()
            crc = self._stamps[signature] = zlib.crc32(signature.encode())
        return ((seq & 0xFFFFFFFF) << 32) | crc

    def count(self, stats: Any) -> None:
        """Add the bytes moved through the arena since the last count to ``stats`` (a
        TransportStats: the status views show a rank's traffic by every path)."""
        ctx = self.context
        sent, received = ctx.sent, ctx.received  # the thread may be adding: read once
        stats.bytes_sent += sent - self._counted[0]
        stats.bytes_received += received - self._counted[1]
        self._counted = (sent, received)

    async def run(self, job: Job, silent: list[int], seq: int, signature: str) -> None:
        """Wait for ``job`` (call ``seq``, ``signature``); arena errors become the group's
        (``silent`` gets the global ranks not heard from when it times out)."""
        try:
            await self.engine.run(job)
        except asyncio.CancelledError:  # the call's deadline (or its caller): say who is late
            # the ranks it was waiting for, and those that never made the call (named even
            # when the program had not reached a wait yet: a busy machine)
            late = set(job.late) | set(self.board.absent(seq))
            silent.extend(self.ranks[r] for r in sorted(late))
            raise
        except Poisoned as exc:
            raise _cause_error(exc) from None
        except Stalled as exc:
            silent.extend(self.ranks[r] for r in exc.ranks)
            raise ArenaTimeout(str(exc)) from None
        except Mismatch as exc:
            raise MessageMismatch(
                f"rank {self.ranks[exc.rank]} wrote a different call into the node arena "
                f"than {signature}"
            ) from None
        except Abandoned as exc:
            raise JobAborted(f"the node arena was closed: {exc}") from None
        except ReadFailed as exc:
            raise _read_error(exc, self.ranks[exc.rank], signature) from None

    def relayed(self, job: Job) -> BaseException | None:
        """The error a local rank poisoned the arena with, if it ended ``job``."""
        error = job.error if job.finished else None
        return _cause_error(error) if isinstance(error, Poisoned) else None

    def poison(self, error: BaseException) -> None:
        """Wake every local rank waiting in this arena; they raise ``error`` (rebuilt)."""
        message = error.reason if isinstance(error, PeerFailed) else str(error)
        cause = {"k": type(error).__name__, "m": message, "r": origin_of(error, self.rank)}
        self.board.poison(cause)

    def close(self) -> None:
        self.engine.close()
        self.halves.clear()
        self.region.close()


def _deferred(
    build: Callable[[Context], Program], context: Context, stamp: int, split: Split | None
) -> Program:
    """The program, built when first driven, signing its halves with ``stamp`` and
    timing its reductions into ``split`` (programs run one after another, so they share
    the context)."""
    context.signature, context.split = stamp, split
    yield from build(context)


def _read_error(exc: ReadFailed, rank: int, signature: str) -> Exception:
    if exc.code == errno.ESRCH:
        return PeerFailed(rank=rank, reason=f"its process is gone (read in {signature})")
    return CollectiveError(
        f"{signature}: reading rank {rank}'s input from its memory failed "
        f"({os.strerror(exc.code)}); {READS_SETTING}=off keeps the node arena's all_gather "
        "in the shared region"
    )


def _cause_error(exc: Poisoned) -> Exception:
    kind, message = str(exc.cause.get("k", "")), str(exc.cause.get("m", ""))
    origin = exc.cause.get("r", -1)
    origin = origin if isinstance(origin, int) else -1
    if kind == "PeerFailed":
        return PeerFailed(rank=origin, reason=message)
    if kind in ("JobAborted", "TransportClosed"):
        return JobAborted(message)
    return relayed_error(kind, message, origin)
