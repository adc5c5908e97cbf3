"""The engine behind the transport contract, shared by the TCP mesh and the in-memory
transport.

A :class:`MailboxTransport` matches arriving messages to posted receives in its
:class:`~shardwire.worker.transport.mailbox.Mailbox` (early ones wait there, within a
byte budget), passes a group's failure on to its members through the
:class:`~shardwire.worker.transport.relay.Relay`, and keeps the loop polling while a
small receive waits (:class:`~shardwire.worker.transport.poll.BusyPoll`). A subclass
moves the bytes: ``_start_send`` and ``post`` hand a message to the wire, and it calls
``mailbox.deliver`` (or lands a payload in a posted receive) when one arrives.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
from collections.abc import Awaitable, Sequence

import numpy as np

from shardwire.protocol import Tag, TensorMeta, TransportClosed, check_dtype
from shardwire.protocol.errors import InvalidArgument, InvalidState
from shardwire.worker.transport.base import (
    DEFAULT_MAX_EARLY_BYTES,
    DEFAULT_TIMEOUT,
    Fold,
    Transport,
)
from shardwire.worker.transport.mailbox import Mailbox
from shardwire.worker.transport.place import Place
from shardwire.worker.transport.poll import BusyPoll
from shardwire.worker.transport.receive import MailboxReceive, TransportTimeout
from shardwire.worker.transport.relay import Relay

log = logging.getLogger("shardwire.worker")


class MailboxTransport(Transport):
    """A transport whose receives are matched in a mailbox (see the module docstring)."""

    def __init__(
        self,
        place: Place | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_early_bytes: int = DEFAULT_MAX_EARLY_BYTES,
    ):
        super().__init__(place, timeout=timeout)
        rank = place.rank if place is not None else -1
        self.relay = Relay(self)
        self.mailbox = Mailbox(
            rank, max_early_bytes=max_early_bytes, on_drain=self._resume, on_notice=self.relay.heard
        )
        self._error: BaseException | None = None
        self._departed: dict[int, BaseException] = {}
        self._closed = False
        self.poll = BusyPoll()  # waiting receives keep the loop polling this long

    def _settle(self, place: Place) -> None:
        """Take this process's place (once)."""
        if self._place is not None:
            raise InvalidState(f"the transport already has its place: {self._place}")
        self._place = place
        self.mailbox.rank = place.rank

    # ---- the contract ------------------------------------------------------------------

    async def send(
        self,
        dst: int,
        array: np.ndarray,
        *,
        tag: Tag,
        op: str = "p2p",
        timeout: float | None = None,
    ) -> None:
        """Send ``array`` to ``dst``; returns once ``array`` may be modified again."""
        self.check_usable()
        place = self._check_peer(dst)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        meta = TensorMeta(
            place.rank, tag, op, check_dtype(array.dtype), array.shape, place.generation
        )
        pending = self._start_send(dst, meta, array)
        if pending is not None:  # only a send that did not complete at once needs a timer
            try:
                limit = self.timeout if timeout is None else timeout
                async with asyncio.timeout(None if limit == math.inf else limit):
                    await pending
            except ConnectionError:
                self.check_usable()  # a lost peer poisons the transport: raise why
                raise
            except TimeoutError:
                self.check_usable()
                raise TransportTimeout(
                    f"rank {self.rank}: send of {op} #{tag.seq} to rank {dst} timed out"
                ) from None
        self.stats.bytes_sent += array.nbytes
        self.stats.messages_sent += 1

    def irecv(
        self,
        src: int,
        *,
        tag: Tag,
        op: str = "p2p",
        out: np.ndarray | None = None,
        timeout: float | None = None,
        fold: Fold | None = None,
    ) -> MailboxReceive:
        self.check_usable()
        self._check_peer(src)
        if out is not None:
            check_dtype(out.dtype)
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise InvalidArgument("recv(out=...) needs a writeable C-contiguous array")
        posted = self.mailbox.post(src, tag, op, out, fold)
        future = posted.future
        if not future.done():
            if src in self._departed:
                self.mailbox.withdraw(src, tag, future)
                future.set_exception(self._departed[src])
                future.exception()  # raised by wait(); never logged as unretrieved
            else:
                self._posted(src)
        limit = self.timeout if timeout is None else timeout
        nbytes = 0 if out is None else out.nbytes
        return MailboxReceive(self, src, tag, op, posted, limit=limit, nbytes=nbytes)

    async def recv_any(
        self,
        *,
        tag: Tag,
        op: str = "p2p",
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> tuple[int, np.ndarray]:
        """Receive the next message with ``tag`` from any rank: (its rank, the array)."""
        self.check_usable()
        if out is not None:
            check_dtype(out.dtype)
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise InvalidArgument("recv_any(out=...) needs a writeable C-contiguous array")
        future = self.mailbox.post_any(tag, op, out)
        limit = self.timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(None if limit == math.inf else limit):
                src, array = await future
        except TimeoutError:
            self.mailbox.withdraw_any(tag, future)
            self.check_usable()
            raise TransportTimeout(
                f"rank {self.rank}: receive of {op} #{tag.seq} from any rank timed out "
                f"after {limit:g} s"
            ) from None
        except asyncio.CancelledError:
            self.mailbox.withdraw_any(tag, future)
            raise
        self.stats.bytes_received += array.nbytes
        self.stats.messages_received += 1
        return src, array

    def poison_group(self, group: int, error: BaseException, members: Sequence[int]) -> None:
        """See :meth:`Transport.poison_group`; the others hear through the relay."""
        self.mailbox.poison_group(group, error)
        if self._error is None and not self._closed:
            self.relay.start(group, error, members)

    def group_error(self, group: int) -> BaseException | None:
        return self.mailbox.group_error(group)

    def abort(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.mailbox.fail(self._error)
        self.groups.aborted(self._error)
        self._on_abort()

    def depart(self, peer: int, exc: BaseException) -> None:
        """``peer`` left cleanly: receives from it that cannot complete raise ``exc``."""
        self._departed[peer] = exc
        self.mailbox.fail(exc, src=peer)

    def has_departed(self, peer: int) -> bool:
        """Whether ``peer`` left cleanly (nothing more will come from it)."""
        return peer in self._departed

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.mailbox.fail(TransportClosed(f"{self.who}: transport closed"))
        try:
            await self._close()
        except Exception:  # closing goes on; the error is the owner's to read in the log
            log.exception("%s: error while closing the transport", self.who)

    # ---- for subclasses --------------------------------------------------------------

    @abc.abstractmethod
    def _start_send(self, dst: int, meta: TensorMeta, array: np.ndarray) -> Awaitable[None] | None:
        """Start sending; return what to await if ``array`` is not yet reusable."""

    @abc.abstractmethod
    def post(self, dst: int, meta: TensorMeta, array: np.ndarray) -> None:
        """Queue a small message to ``dst`` without waiting (its bytes are copied): the
        relay's failure notices, which must not wait behind anything."""

    @abc.abstractmethod
    async def _close(self) -> None: ...

    def _on_abort(self) -> None:
        """Hook: a transport may drop connections when poisoned."""

    def _resume(self) -> None:
        """Hook: the early-arrival backlog drained below its budget."""

    def _posted(self, src: int) -> None:
        """Hook: a receive from ``src`` was posted and is waiting."""

    # ---- helpers ---------------------------------------------------------------------

    def _check_peer(self, peer: int) -> Place:
        place = self.place
        if not 0 <= peer < place.world_size or peer == place.rank:
            raise InvalidArgument(
                f"rank {place.rank}: peer {peer} is not another rank of world size "
                f"{place.world_size}"
            )
        return place
