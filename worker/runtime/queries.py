"""What a control connection asks the coordinator besides joining: peers' addresses,
the coordinator's clock, the job's status (each a bounded request of
:class:`~shardwire.worker.runtime.control.ControlClient`)."""

from __future__ import annotations

import time
from typing import Any

from shardwire.protocol import RendezvousError
from shardwire.protocol.clock import ClockQuery, ClockReply
from shardwire.protocol.clock import offset as estimate_offset
from shardwire.protocol.messages import STATUS_PAGE, StatusReply, StatusRequest
from shardwire.protocol.placement import PEER_PAGE, Member, PeerPage, PeerQuery


class Queries:
    """The coordinator's answers to a control connection's questions."""

    _placed: int  # the generation of this worker's placement

    async def _request(self, msg: Any, expect: type, timeout: float) -> Any:
        raise NotImplementedError

    async def peers(self, ranks: list[int], *, timeout: float) -> list[Member]:
        """The members with ``ranks`` (of this worker's generation), asked in queries of
        at most ``PEER_PAGE`` ranks, each bounded by ``timeout``."""
        members: list[Member] = []
        for start in range(0, len(ranks), PEER_PAGE):
            asked = ranks[start : start + PEER_PAGE]
            page = await self._request(PeerQuery(ranks=asked), PeerPage, timeout)
            if page.generation != self._placed or [m.rank for m in page.members] != asked:
                raise RendezvousError(
                    f"the coordinator answered ranks {[m.rank for m in page.members][:8]} of "
                    f"generation {page.generation} to a query for ranks {asked[:8]} of "
                    f"generation {self._placed}",
                    code="stale_generation",
                )
            members += page.members
        return members

    async def clock_offset(self, *, probes: int, timeout: float) -> tuple[float, float]:
        """What to add to this process's ``time.monotonic()`` to read the coordinator's
        clock, and the error bound (see ``protocol/clock.py``); each probe bounded."""
        seen = []
        for _ in range(probes):
            sent = time.monotonic()
            reply = await self._request(ClockQuery(sent=sent), ClockReply, timeout)
            seen.append((sent, reply.now, time.monotonic()))
        return estimate_offset(seen)

    async def status(self, *, timeout: float) -> StatusReply:
        """Ask the coordinator for the job state (role "client" connections), page by
        page: every rank's row, each reply inside a control frame at any job size."""
        reply = await self._request(StatusRequest(), StatusReply, timeout)
        ranks = list(reply.ranks)
        for _ in range(reply.total // STATUS_PAGE + 1):  # bounded: the rows announced
            if len(ranks) >= reply.total:
                break
            page = await self._request(StatusRequest(offset=len(ranks)), StatusReply, timeout)
            if not page.ranks:  # the job shrank meanwhile
                break
            ranks += page.ranks
        return reply.model_copy(update={"ranks": ranks, "total": len(ranks)})
