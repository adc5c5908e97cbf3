"""Peer copies on the wire: a whole snapshot to its holder, and the pieces of one a
restoring rank needs (each a msgpack header, then the values' bytes, on point-to-point
tags of the copies' own group)."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from shardwire.worker.collectives import Group
from shardwire.worker.fsdp.copyplan import Piece, Snapshot, bytes_pieces, cut, digest, pieces_bytes

_HEADER, _DATA = 1, 2  # a copy's two messages
_PIECES = 16  # a restore's: 16 + 2 * old rank (header), + 1 (values)


async def send(group: Group, to: int, snap: Snapshot) -> None:
    header = np.frombuffer(msgpack.packb(snap.meta), np.uint8)
    await group.send(header, to, tag=_HEADER)
    await group.send(snap.data, to, tag=_DATA)


async def receive(group: Group, of: int) -> Snapshot:
    header = await group.recv(of, tag=_HEADER)
    meta = msgpack.unpackb(np.ascontiguousarray(header).tobytes())
    data = await group.recv(of, tag=_DATA)
    return Snapshot(meta, np.ascontiguousarray(data).view(np.uint8).reshape(-1))


def _piece_tags(old: int) -> tuple[int, int]:
    return _PIECES + 2 * old, _PIECES + 2 * old + 1


async def send_pieces(group: Group, to: int, snap: Snapshot, part: tuple[int, ...]) -> None:
    """The values of ``snap`` that rank ``to``'s ``part`` holds, with the snapshot's meta."""
    table, data = pieces_bytes(cut(snap, *part))
    header = {"meta": snap.meta, "table": table, "digest": digest(data)}
    head, body = _piece_tags(snap.have.rank)
    await group.send(np.frombuffer(msgpack.packb(header), np.uint8), to, tag=head)
    await group.send(data, to, tag=body)


async def receive_pieces(
    group: Group, of: int, old: int
) -> tuple[dict[str, Any], list[Piece], bool]:
    """Old rank ``old``'s pieces and meta from rank ``of``, and whether they are intact."""
    head, body = _piece_tags(old)
    header = msgpack.unpackb(np.ascontiguousarray(await group.recv(of, tag=head)).tobytes())
    data = np.ascontiguousarray(await group.recv(of, tag=body)).view(np.uint8).reshape(-1)
    return header["meta"], bytes_pieces(header["table"], data), digest(data) == header["digest"]
