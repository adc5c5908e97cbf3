"""Opening a group's node arena, over the group's own messages.

Opening happens inside the group's first arena call: local rank 0 creates the region
and offers its name and nonce, every other rank attaches (with the checks of
``arena.region``) and answers, rank 0 unlinks the name and sends one verdict to all.
Offer and verdict go down a binomial tree and the answers up one, so a rank talks to
about log2 k of its k local peers while the arena opens. Either every rank of the group
uses the arena or none does, never a mix; a region that cannot be made is one warning
naming the size and the setting, and the group keeps to its links.

The same exchange finds out whether the ranks may read each other's memory
(``arena.peerread``): rank 0 offers bytes to read with the region, every other rank
reads them and offers its own with its answer, rank 0 reads those, and the verdict
carries every rank's process id when all reads succeeded (else none: the group's
all_gather keeps to the shared region, and rank 0 says why at INFO).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from shardwire.protocol import ProtocolError
from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.worker.arena import atomics, peerread
from shardwire.worker.arena.node import NodeArena
from shardwire.worker.arena.peerread import Bait
from shardwire.worker.arena.region import Geometry, Region
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.small import broadcast_tree, gather_blobs_tree
from shardwire.worker.transport.arena_settings import SLOT_SETTING, ArenaSettings

log = logging.getLogger("shardwire.worker")

_SETUP_STEP = 3 << 30  # message steps of the opening exchange, apart from any algorithm's
_OFFER, _ANSWERS, _VERDICT = _SETUP_STEP, _SETUP_STEP + 2, _SETUP_STEP + 4  # its phases


async def open_arena(call: Call, settings: ArenaSettings, what: str) -> NodeArena | None:
    """Open the arena of ``call``'s ranks (all on this node); None: they keep to TCP.
    ``call`` is the group's first arena call (its messages carry the exchange)."""
    geometry = Geometry(call.size, settings.slot_bytes)
    bait = peerread.Bait() if settings.reads() else None
    if call.rank == 0:
        opened = await _create(call, settings, geometry, what, bait)
    else:
        opened = await _attach(call, settings, geometry, what, bait)
    if opened is None:
        return None
    region, pids = opened
    return NodeArena(region, call.rank, tuple(call.ranks), settings, pids)


async def _create(
    call: Call, settings: ArenaSettings, geometry: Geometry, what: str, bait: Bait | None
) -> tuple[Region, list[int] | None] | None:
    """Local rank 0: make the region, offer it, collect the answers, send the verdict
    (the region and, if the ranks may read each other, their process ids)."""
    region: Region | None = None
    offer: dict[str, Any]
    try:
        if atomics.missing():
            raise OSError(atomics.missing())
        region, nonce = Region.create(settings.run_id, geometry)
        offer = {"name": region.path.name, "nonce": nonce.hex()}
        if bait is not None:
            offer["reads"] = bait.offer()
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
        pids = _readers(bait, answers, what) if ok else None
        await _tell(call, {"ok": ok, "pids": pids}, _VERDICT)
    except BaseException:
        _drop(region)  # the error's frames must not keep the mapping alive
        raise
    if ok:
        assert region is not None
        return region, pids
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
    call: Call, settings: ArenaSettings, geometry: Geometry, what: str, bait: Bait | None
) -> tuple[Region, list[int] | None] | None:
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
    if bait is not None and "reads" in offer:  # whether this rank may read rank 0, and its bait
        answer["reads"] = {**bait.offer(), "refused": peerread.probe(offer["reads"], 0)}
    try:
        await _hear_all(call, answer, _ANSWERS)
        verdict = await _tell(call, None, _VERDICT)
    except BaseException:
        _drop(region)
        raise
    if verdict.get("ok") and region is not None:
        return region, _pids(call, verdict.get("pids"))
    log.info("%s: no node arena: %s", what, answer.get("error") or "local rank 0 gave up")
    _drop(region)
    return None


def _readers(bait: Bait | None, answers: list[dict], what: str) -> list[int] | None:
    """Every local rank's process id if all may read each other's memory (rank 0 tried
    each other rank's bait; each of them tried rank 0's), else None."""
    if bait is None:
        return None
    pids, refused = [os.getpid()], []
    for p, answer in enumerate(answers[1:], 1):
        reads = answer.get("reads")
        if not isinstance(reads, dict):
            refused.append(f"local rank {p} does not read peers' memory")
            continue
        why = str(reads.get("refused", "")) or peerread.probe(reads, p)
        if why:
            refused.append(why)
        else:  # the probe read its bait: its pid is a number
            pids.append(int(reads["pid"]))
    if not refused:
        return pids
    log.info(
        "%s: its ranks do not read each other's memory (%s); its all_gather goes through "
        "the shared region",
        what,
        refused[0],
    )
    return None


def _pids(call: Call, pids: Any) -> list[int] | None:
    if pids is None:
        return None
    if (
        not isinstance(pids, list)
        or len(pids) != call.size
        or not all(isinstance(p, int) and p > 0 for p in pids)
    ):
        raise ProtocolError(f"rank {call.ranks[0]} sent a malformed arena verdict")
    return pids


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
