"""Telling a group's members that it failed, over O(log n) links per rank.

A rank whose collective fails (timeout, mismatch, cancellation, corrupted data) poisons
the group: every member must fail its receives of that group at once rather than wait
out its own timeout. Sending the notice to every member would connect each failing rank
to all the others (and, when all time out together, every pair). Instead the notice
climbs a binomial tree over the group's ranks, sorted, to the lowest rank (each rank
passes it to its parent ``i & (i - 1)``), which sends it down the same tree. Each rank
passes a group's notice on at most once each way, so there are at most 2(n - 1) notices
however many ranks fail, and a rank talks to at most 2·log2(n) members. The notice
carries the group's ranks as runs, so a rank that has not opened the group yet relays
it too. A dead rank on the way cuts the relay below it; the coordinator's abort covers
that case.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardwire.protocol import ShardwireError, Tag, TensorMeta
from shardwire.protocol.codec import pack_object
from shardwire.protocol.errors import origin_of
from shardwire.protocol.messages import Poison, encode_message
from shardwire.protocol.ranks import from_runs, to_runs
from shardwire.worker.transport.mailbox import POISON_OP

if TYPE_CHECKING:
    from shardwire.worker.transport.messaging import MailboxTransport

log = logging.getLogger("shardwire.worker")


def binomial_children(index: int, size: int) -> list[int]:
    """The children of ``index`` in the binomial tree over ``0 .. size-1`` rooted at 0
    (``index``'s parent is ``index & (index - 1)``)."""
    low = index & -index if index else 1 << max(0, size - 1).bit_length()
    out, step = [], 1
    while step < low and index + step < size:
        out.append(index + step)
        step <<= 1
    return out


class Relay:
    """One transport's part in relaying poison notices (see the module docstring)."""

    def __init__(self, transport: MailboxTransport):
        self._t = transport
        self._passed: dict[int, set[str]] = {}  # group -> ways its notice went on

    def start(self, group: int, error: BaseException, members: Sequence[int]) -> None:
        """This rank poisoned ``group`` (of ``members``, its ranks): tell the others."""
        ranks = sorted(members)
        notice = Poison(
            group=group,
            error=type(error).__name__[:256],
            message=str(error)[:8192],
            runs=to_runs(ranks) or [],
            origin=origin_of(error, self._t.rank),
        )
        self._pass(notice, ranks)

    def heard(self, notice: Poison) -> None:
        """A member's notice arrived (the group already failed here): pass it on."""
        t = self._t
        if t.error is not None or t.closed:
            return
        if notice.runs:
            ranks = from_runs(notice.runs)
        elif (group := t.groups.get(notice.group)) is not None:
            ranks = sorted(group.ranks)
        else:  # an irregular group this rank has no copy of: its members hear otherwise
            log.debug("%s: poison notice of unknown group %d not relayed", t.who, notice.group)
            return
        self._pass(notice, ranks)

    def _pass(self, notice: Poison, ranks: list[int]) -> None:
        t = self._t
        if t.rank not in ranks:
            return
        me = ranks.index(t.rank)
        way = "down" if notice.down or me == 0 else "up"
        passed = self._passed.setdefault(notice.group, set())
        if way in passed:
            return
        passed.add(way)
        if way == "down":
            notice = notice.model_copy(update={"down": True})
        report = np.frombuffer(pack_object(encode_message(notice)), np.uint8)
        meta = TensorMeta.for_array(
            report, src=t.rank, tag=Tag(notice.group, 0), op=POISON_OP, generation=t.generation
        )
        for i in binomial_children(me, len(ranks)) if way == "down" else [me & (me - 1)]:
            peer = ranks[i]
            if t.has_departed(peer):
                continue
            try:
                t.post(peer, meta, report)
            except (ShardwireError, OSError) as exc:  # that peer is gone: it cannot hear
                log.debug("%s: poison notice to rank %d not sent: %s", t.who, peer, exc)
