"""Do all ranks hold rank 0's value? Asked once per setup (the model's fingerprint, the
gradient list's shapes), answered with bytes that grow with the group, not its square:
rank 0's value is broadcast, each rank compares its own, and only the verdicts travel
back to rank 0, which tells every rank who differs."""

from __future__ import annotations

from typing import Any

from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.worker.collectives.group import Group

SHOWN = 16  # differing ranks named (then their count)


async def differing_from_root(group: Group, value: Any) -> tuple[list[int], int]:
    """(the first differing ranks, how many differ), the same on every rank; ``value``
    is compared as msgpack carries it (tuples and lists alike)."""
    mine = unpack_object(pack_object(value))
    theirs = await group.broadcast_object(mine if group.rank == 0 else None)
    verdicts = await group.gather_object(mine != theirs)
    differ = [r for r, d in enumerate(verdicts) if d] if verdicts is not None else []
    shown, count = await group.broadcast_object([differ[:SHOWN], len(differ)])
    return list(shown), int(count)
