"""Point-to-point messages of a group: the same :class:`Pending` handle as a collective
(``await`` it, or ``.start()`` it), bounded by the group's timeout or the call's own.

Messages of a group are tagged ``Tag(group id, P2P_BASE + tag, 0)``: user tags below
2**40 sit far above any collective's sequence number, so they never meet a collective's
frames, and groups never see each other's messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardwire.protocol import Tag
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.backends.algorithms import P2P_BASE
from shardwire.worker.collectives.work import Pending

if TYPE_CHECKING:
    from shardwire.worker.collectives.group import Group


def tag_of(group: Group, tag: int) -> Tag:
    if not 0 <= tag < P2P_BASE:
        raise InvalidArgument(f"tag must be in [0, 2**40), got {tag}")
    return Tag(group.group_id, P2P_BASE + tag, 0)


def _peer(group: Group, rank: int, role: str) -> int:
    group._check()
    if not 0 <= rank < group.size:
        raise InvalidArgument(f"{role} {rank} is not a rank of this group of {group.size}")
    return group.ranks[rank]


def send(group: Group, x: np.ndarray, dst: int, tag: int, limit: float) -> Pending[None]:
    to = _peer(group, dst, "dst")
    sending = group.transport.send(to, x, tag=tag_of(group, tag), op="p2p", timeout=limit)
    return Pending(group, sending)


def recv(
    group: Group, src: int, tag: int, out: np.ndarray | None, limit: float
) -> Pending[np.ndarray]:
    frm = _peer(group, src, "src")
    receiving = group.transport.recv(frm, tag=tag_of(group, tag), op="p2p", out=out, timeout=limit)
    return Pending(group, receiving)


def recv_any(
    group: Group, tag: int, out: np.ndarray | None, limit: float
) -> Pending[tuple[int, np.ndarray]]:
    group._check()
    return Pending(group, _any(group, tag_of(group, tag), out, limit))


async def _any(
    group: Group, tag: Tag, out: np.ndarray | None, limit: float
) -> tuple[int, np.ndarray]:
    src, array = await group.transport.recv_any(tag=tag, op="p2p", out=out, timeout=limit)
    return group.ranks.index(src), array
