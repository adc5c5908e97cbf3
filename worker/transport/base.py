"""The transport contract that collectives and process groups are written against.

``send`` returns once the array may be reused (its bytes are in the kernel or copied);
``recv`` completes with the matching message, written into ``out`` when given. Both are
bounded by a timeout. A transport is *poisoned* by :meth:`Transport.abort` (a peer
failed, the coordinator aborted the job): every pending and later call raises the
poisoning error.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import numpy as np

from shardwire.protocol import Tag, TensorMeta, TransportClosed, check_dtype
from shardwire.protocol.errors import InvalidArgument, InvalidState
from shardwire.worker.transport.mailbox import Fold, Mailbox
from shardwire.worker.transport.place import Place
from shardwire.worker.transport.poll import BusyPoll
from shardwire.worker.transport.receive import Receive, TransportTimeout
from shardwire.worker.transport.relay import Relay
from shardwire.worker.transport.traffic import TransportStats

log = logging.getLogger("shardwire.worker")

DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_EARLY_BYTES = 1 << 30


class Transport(abc.ABC):
    """Point-to-point messaging between the ranks of one job."""

    def __init__(
        self,
        place: Place | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_early_bytes: int = DEFAULT_MAX_EARLY_BYTES,
    ):
        self._place = place
        self.timeout = timeout
        self.stats = TransportStats()
        rank = place.rank if place is not None else -1
        self.relay = Relay(self)
        self.mailbox = Mailbox(
            rank, max_early_bytes=max_early_bytes, on_drain=self._resume, on_notice=self.relay.heard
        )
        self._error: BaseException | None = None
        self._departed: dict[int, BaseException] = {}
        self._closed = False
        # Open collective groups by group id, kept by the groups themselves: a group id is
        # unique on a transport while its group is open (their frames share the tags).
        self.groups: dict[int, Any] = {}
        # The node of every rank, by rank (None: one node, as far as known).
        self.nodes: Sequence[Hashable] | None = None
        self.poll = BusyPoll()  # waiting receives keep the loop polling this long
        # This node runs more ranks than it has CPUs (from the placement): algorithms that
        # need every rank running at once lose there.
        self.crowded = False
        # Groups whose ranks share this node run their collectives through a node arena
        # with these settings (an ArenaSettings), or never (None).
        self.arena: Any = None
        # Called with the error when the transport is poisoned (groups wake their arena).
        self.abort_hooks: list[Callable[[BaseException], None]] = []

    # ---- place -------------------------------------------------------------------------

    @property
    def place(self) -> Place:
        """This process's rank, world size and generation (from its placement)."""
        if self._place is None:
            raise InvalidState("the transport has no place in the job yet (no placement)")
        return self._place

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def world_size(self) -> int:
        return self.place.world_size

    @property
    def generation(self) -> int:
        return self.place.generation

    def _settle(self, place: Place) -> None:
        """Take this process's place (once)."""
        if self._place is not None:
            raise InvalidState(f"the transport already has its place: {self._place}")
        self._place = place
        self.mailbox.rank = place.rank

    @property
    def _who(self) -> str:
        return f"rank {self._place.rank}" if self._place is not None else "a rank without a place"

    # ---- contract ------------------------------------------------------------------

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

    async def recv(
        self,
        src: int,
        *,
        tag: Tag,
        op: str = "p2p",
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Receive the next message from ``src`` with ``tag`` (into ``out`` if given)."""
        return await self.irecv(src, tag=tag, op=op, out=out, timeout=timeout).wait()

    def irecv(
        self,
        src: int,
        *,
        tag: Tag,
        op: str = "p2p",
        out: np.ndarray | None = None,
        timeout: float | None = None,
        fold: Fold | None = None,
    ) -> Receive:
        """Post a receive now (so the payload can land in ``out``); await ``wait()`` later.
        ``fold`` reduces the message into the caller's accumulator before it completes
        (from shared memory without copying it into ``out`` first)."""
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
        return Receive(self, src, tag, op, posted, limit=limit, nbytes=nbytes)

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
        """Fail every receive of ``group`` here, and tell its other ``members`` (all its
        ranks) to do the same, through :class:`~shardwire.worker.transport.relay.Relay`."""
        self.mailbox.poison_group(group, error)
        if self._error is None and not self._closed:
            self.relay.start(group, error, members)

    def group_error(self, group: int) -> BaseException | None:
        """The error another member (or this rank) poisoned ``group`` with, if any."""
        return self.mailbox.group_error(group)

    def abort(self, exc: BaseException) -> None:
        """Poison the transport: pending and later calls raise ``exc``."""
        if self._error is None:
            self._error = exc
        self.mailbox.fail(self._error)
        for hook in list(self.abort_hooks):
            hook(self._error)
        self._on_abort()

    def depart(self, peer: int, exc: BaseException) -> None:
        """``peer`` left cleanly: receives from it that cannot complete raise ``exc``."""
        self._departed[peer] = exc
        self.mailbox.fail(exc, src=peer)

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def aclose(self) -> None:
        """Release every socket and task. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.mailbox.fail(TransportClosed(f"{self._who}: transport closed"))
        try:
            await self._close()
        except Exception:  # closing goes on; the error is the owner's to read in the log
            log.exception("%s: error while closing the transport", self._who)

    # ---- for subclasses --------------------------------------------------------------

    @abc.abstractmethod
    def _start_send(self, dst: int, meta: TensorMeta, array: np.ndarray) -> Awaitable[None] | None:
        """Start sending; return what to await if ``array`` is not yet reusable."""

    @abc.abstractmethod
    def _post(self, dst: int, meta: TensorMeta, array: np.ndarray) -> None:
        """Queue a small message without waiting (its bytes are copied)."""

    @abc.abstractmethod
    async def _close(self) -> None: ...

    def path_to(self, dst: int, nbytes: int) -> str:
        """The path a payload of ``nbytes`` to ``dst`` takes now ("memory", "tcp" or
        "shm"), for timelines."""
        return "memory"

    def _on_abort(self) -> None:
        """Hook: a transport may drop connections when poisoned."""

    def _resume(self) -> None:
        """Hook: the early-arrival backlog drained below its budget."""

    def _posted(self, src: int) -> None:
        """Hook: a receive from ``src`` was posted and is waiting."""

    # ---- helpers ---------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise why this transport cannot be used (its abort error, or closed)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransportClosed(f"{self._who}: transport is closed")

    def _check_peer(self, peer: int) -> Place:
        place = self.place
        if not 0 <= peer < place.world_size or peer == place.rank:
            raise InvalidArgument(
                f"rank {place.rank}: peer {peer} is not another rank of world size "
                f"{place.world_size}"
            )
        return place
