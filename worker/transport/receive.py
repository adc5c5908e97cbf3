"""A posted receive (from :meth:`Transport.irecv`) and how it is awaited: at once when its
payload is already here, under its own timer when it has a limit, or bounded by the
caller (a collective's deadline) when it has none."""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from shardwire.protocol import Tag
from shardwire.worker.transport.base import Receive, TransportTimeout
from shardwire.worker.transport.mailbox import Posted
from shardwire.worker.transport.poll import POLL_MAX_BYTES

if TYPE_CHECKING:
    from shardwire.worker.transport.messaging import MailboxTransport


__all__ = ["MailboxReceive", "TransportTimeout"]


class MailboxReceive(Receive):
    """A receive posted in the mailbox of a :class:`MailboxTransport`."""

    __slots__ = (
        "_posted",
        "_transport",
        "awaited_at",
        "future",
        "limit",
        "nbytes",
        "op",
        "received",
        "src",
        "tag",
    )

    def __init__(
        self,
        transport: MailboxTransport,
        src: int,
        tag: Tag,
        op: str,
        posted: Posted,
        *,
        limit: float,
        nbytes: int = 0,
    ):
        self._transport, self._posted = transport, posted
        self.src, self.tag, self.op, self.future, self.limit = src, tag, op, posted.future, limit
        self.nbytes = nbytes  # the size expected (of ``out``), 0 if unknown
        self.received = False  # set once wait() returned the array
        self.awaited_at = 0.0  # when wait() suspended for it (0: it was here already)

    @property
    def began(self) -> float:
        """When the payload began to arrive, if after it was posted (else 0)."""
        return self._posted.began

    def done(self) -> bool:
        return self.future.done()

    async def wait(self) -> np.ndarray:
        """The received array; raises on timeout, mismatch or a failed peer."""
        t = self._transport
        if self.future.done():  # it was already here: no timer, no suspension
            result = self.future.result()
        else:
            self.awaited_at = time.monotonic()
            if self.nbytes <= POLL_MAX_BYTES:
                t.poll.hold(self.future)
            result = await self._arrival()
        t.stats.bytes_received += result.nbytes
        t.stats.messages_received += 1
        self.received = True
        return result

    async def _arrival(self) -> np.ndarray:
        """Wait for the payload; a finite limit arms a plain timer handle (measured
        cheaper than asyncio.timeout() on the hot path), an infinite one leaves the
        bound to the caller (a collective's deadline)."""
        future, mailbox = self.future, self._transport.mailbox
        timer = None
        if self.limit != math.inf:
            timer = asyncio.get_running_loop().call_later(self.limit, self._expire)
        try:
            return await future
        except TransportTimeout:
            mailbox.withdraw(self.src, self.tag, future)
            self._transport.check_usable()  # a poisoned transport says why, not the timeout
            raise
        except asyncio.CancelledError:
            mailbox.withdraw(self.src, self.tag, future)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _expire(self) -> None:
        if not self.future.done():
            self.future.set_exception(
                TransportTimeout(
                    f"rank {self._transport.rank}: receive of {self.op} #{self.tag.seq} from "
                    f"rank {self.src} timed out after {self.limit:g} s"
                )
            )

    def cancel(self) -> None:
        """Withdraw the receive if its payload has not started arriving."""
        if not self.future.done():
            self._transport.mailbox.withdraw(self.src, self.tag, self.future)
            self.future.cancel()
