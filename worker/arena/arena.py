"""A group's node arena: region, board, clocks and engine, and how it is opened.

Opening happens inside the group's first arena call, over the group's own messages:
local rank 0 creates the region and offers its name and nonce, every other rank
attaches (with the checks of ``region``) and answers, rank 0 unlinks the name and sends
one verdict to all. Offer and verdict go down a binomial tree and the answers up one,
so a rank talks to about log2 k of its k local peers while the arena opens. Either
every rank of the group uses the arena or none does, never a mix; a region that cannot
be made is one warning naming the size and the setting, and the group keeps to TCP.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from shardwire.protocol import JobAborted, MessageMismatch, PeerFailed, ProtocolError
from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.protocol.errors import relayed_error
from shardwire.worker.arena import atomics
from shardwire.worker.arena.board import Board, Poisoned, Stalled
from shardwire.worker.arena.engine import Abandoned, Engine, Job
from shardwire.worker.arena.programs import Clock, Context, HalfViews, Mismatch, Program
from shardwire.worker.arena.region import Geometry, Region
from shardwire.worker.arena.settings import SLOT_SETTING, ArenaSettings
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.small import broadcast_tree, gather_blobs_tree
from shardwire.worker.collectives.split import Split

log = logging.getLogger("shardwire.worker")

_SETUP_STEP = 3 << 30  # message steps of the opening exchange, apart from any algorithm's
_OFFER, _ANSWERS, _VERDICT = _SETUP_STEP, _SETUP_STEP + 2, _SETUP_STEP + 4  # its phases


class ArenaTimeout(TimeoutError):
    """An arena wait passed its deadline (the group turns it into CollectiveTimeout)."""


class NodeArena:
    """One group's arena on this node, attached."""

    def __init__(self, region: Region, me: int, ranks: tuple[int, ...], settings: ArenaSettings):
        self.region = region
        self.ranks = ranks  # local index -> global rank
        self.board = Board(region, me)
        g = region.geometry
        assert region.map is not None
        offsets = [[g.half(r, 0), g.half(r, 1)] for r in range(g.ranks)]
        self.halves = HalfViews(region.map, offsets, g.half_bytes)
        self.clock = Clock()
        self.context = Context(self.board, self.halves, self.clock, 0)
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
        return self.engine.submit(program, deadline, split)

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
        return engine.express(build(context), deadline, split)

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

    def relayed(self, job: Job) -> BaseException | None:
        """The error a local rank poisoned the arena with, if it ended ``job``."""
        error = job.error if job.finished else None
        return _cause_error(error) if isinstance(error, Poisoned) else None

    def poison(self, error: BaseException) -> None:
        """Wake every local rank waiting in this arena; they raise ``error`` (rebuilt)."""
        if isinstance(error, PeerFailed):
            cause: dict[str, Any] = {"k": "PeerFailed", "m": error.reason, "r": error.rank}
        else:
            cause = {"k": type(error).__name__, "m": str(error), "r": -1}
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


def _cause_error(exc: Poisoned) -> Exception:
    kind, message = str(exc.cause.get("k", "")), str(exc.cause.get("m", ""))
    if kind == "PeerFailed":
        rank = exc.cause.get("r", -1)
        return PeerFailed(rank=rank if isinstance(rank, int) else -1, reason=message)
    if kind in ("JobAborted", "TransportClosed"):
        return JobAborted(message)
    return relayed_error(kind, message)


async def open_arena(call: Call, settings: ArenaSettings, what: str) -> NodeArena | None:
    """Open the arena of ``call``'s ranks (all on this node); None: they keep to TCP.
    ``call`` is the group's first arena call (its messages carry the exchange)."""
    geometry = Geometry(call.size, settings.slot_bytes)
    if call.rank == 0:
        region = await _create(call, settings, geometry, what)
    else:
        region = await _attach(call, settings, geometry, what)
    return None if region is None else NodeArena(region, call.rank, tuple(call.ranks), settings)


async def _create(
    call: Call, settings: ArenaSettings, geometry: Geometry, what: str
) -> Region | None:
    """Local rank 0: make the region, offer it, collect the answers, send the verdict."""
    region: Region | None = None
    try:
        if atomics.missing():
            raise OSError(atomics.missing())
        region, nonce = Region.create(settings.run_id, geometry)
        offer = {"name": region.path.name, "nonce": nonce.hex()}
    except OSError as exc:
        offer = {"error": str(exc)}
    try:
        await _tell(call, offer, _OFFER)
        answers = await _hear_all(call, {"ok": region is not None}, _ANSWERS)
        if region is not None:
            region.unlink()  # everyone attached (or gave up): the name is no longer needed
        assert answers is not None
        problems = [
            f"rank {call.ranks[p]}: {a.get('error')}"
            for p, a in enumerate(answers)
            if p and not a.get("ok")
        ]
        ok = region is not None and not problems
        await _tell(call, {"ok": ok}, _VERDICT)
    except BaseException:
        _drop(region)  # the error's frames must not keep the mapping alive
        raise
    if ok:
        return region
    log.warning(
        "%s: no node arena (%s); it needs %d bytes of /dev/shm for %d ranks: free "
        "space there or lower %s (now %d). This group moves its data over TCP.",
        what,
        offer.get("error") or "; ".join(problems),
        geometry.size,
        call.size,
        SLOT_SETTING,
        settings.slot_bytes,
    )
    _drop(region)
    return None


async def _attach(
    call: Call, settings: ArenaSettings, geometry: Geometry, what: str
) -> Region | None:
    """Any other local rank: attach what rank 0 offers, answer, take the verdict."""
    offer = await _tell(call, None, _OFFER)
    region = None
    answer: dict[str, Any] = {"ok": False, "error": "no region offered"}
    if "name" in offer:
        try:
            if atomics.missing():
                raise OSError(atomics.missing())
            nonce = bytes.fromhex(str(offer.get("nonce", "")))
            region = Region.attach(settings.run_id, str(offer["name"]), geometry, nonce)
            answer = {"ok": True}
        except (OSError, ProtocolError, ValueError) as exc:
            answer = {"ok": False, "error": str(exc)[:2000]}
    try:
        await _hear_all(call, answer, _ANSWERS)
        verdict = await _tell(call, None, _VERDICT)
    except BaseException:
        _drop(region)
        raise
    if verdict.get("ok") and region is not None:
        return region
    log.info("%s: no node arena: %s", what, answer.get("error") or "local rank 0 gave up")
    _drop(region)
    return None


def _drop(region: Region | None) -> None:
    if region is not None:
        region.unlink()
        region.close()


async def _tell(call: Call, message: dict | None, step: int) -> dict:
    """Local rank 0's ``message`` (None elsewhere), on every rank, down a binomial tree:
    a rank talks to about log2 k others, not rank 0 to all k - 1."""
    payload = None if message is None else np.frombuffer(pack_object(message), np.uint8)
    got = await broadcast_tree(call.sub(range(call.size), step), payload, 0)
    return _message(call, 0, got)


async def _hear_all(call: Call, mine: dict, step: int) -> list[dict] | None:
    """Every rank's ``mine`` on local rank 0, by rank, up a binomial tree; None elsewhere."""
    payload = np.frombuffer(pack_object(mine), np.uint8)
    got = await gather_blobs_tree(call.sub(range(call.size), step), payload, 0)
    return None if got is None else [_message(call, p, blob) for p, blob in enumerate(got)]


def _message(call: Call, peer: int, got: np.ndarray) -> dict:
    message = unpack_object(got.tobytes())
    if not isinstance(message, dict):
        raise ProtocolError(f"rank {call.ranks[peer]} sent a malformed arena message")
    return message
