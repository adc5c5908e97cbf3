"""Opening a group's node arena, over the group's own messages.

Opening happens inside the group's first arena call: local rank 0 creates the region
and offers its name and nonce, every other rank attaches (with the checks of
``arena.region``) and answers, rank 0 unlinks the name and sends one verdict to all.
Offer and verdict go down a binomial tree and the answers up one, so a rank talks to
about log2 k of its k local peers while the arena opens. Either every rank of the group
uses the arena or none does, never a mix; a region that cannot be made is one warning
naming the size and the setting, and the group keeps to its links.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from shardwire.protocol import ProtocolError
from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.worker.arena import atomics
from shardwire.worker.arena.node import NodeArena
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
