"""The transport contract that collectives and process groups are written against.

``send`` returns once the array may be reused (its bytes are in the kernel or copied);
``irecv`` posts a receive whose ``wait()`` completes with the matching message, written
into ``out`` when given. Both are bounded by a timeout. A transport is *poisoned* by
:meth:`Transport.abort` (a peer failed, the coordinator aborted the job): every pending
and later call raises the poisoning error. ``stats`` counts what moved.

The contract holds no machinery: the engine shared by the TCP mesh and the in-memory
transport (a mailbox that matches arrivals to receives, the relay of group failures, the
busy poll) is :class:`~shardwire.worker.transport.messaging.MailboxTransport`. Beside the
contract a transport carries two plain records for the groups over it: the open groups
(:class:`~shardwire.worker.transport.groups.OpenGroups`) and what it learned of the job's
layout (:class:`~shardwire.worker.transport.place.Topology`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import numpy as np

from shardwire.protocol import ShardwireError, Tag, TransportClosed
from shardwire.protocol.errors import InvalidState
from shardwire.worker.transport.groups import OpenGroups
from shardwire.worker.transport.place import Place, Topology
from shardwire.worker.transport.traffic import TransportStats

DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_EARLY_BYTES = 1 << 30

__all__ = [
    "DEFAULT_MAX_EARLY_BYTES",
    "DEFAULT_TIMEOUT",
    "Fold",
    "Receive",
    "Transport",
    "TransportStats",
    "TransportTimeout",
]

# A receive's reduction: fold(piece, at) combines ``piece`` (elements ``at`` onwards of
# the message, flat) into the receiver's accumulator. Transports call it once with the
# whole message, or piece by piece straight from where the bytes arrived (shared memory).
Fold = Callable[[np.ndarray, int], None]


class TransportTimeout(ShardwireError, TimeoutError):
    """A send or receive did not complete within its timeout."""


class Receive(abc.ABC):
    """A posted receive (from :meth:`Transport.irecv`): ``wait()`` returns the array.

    Attributes:
        src: the global rank it receives from; tag: its tag; op: its call's signature.
        received: set once ``wait()`` returned the array.
        awaited_at: when ``wait()`` suspended for it (0: the payload was already here).
    """

    __slots__ = ()
    src: int
    tag: Tag
    op: str
    received: bool
    awaited_at: float

    @property
    @abc.abstractmethod
    def began(self) -> float:
        """When the payload began to arrive, if after it was posted (else 0)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the payload is here (or the receive failed)."""

    @abc.abstractmethod
    async def wait(self) -> np.ndarray:
        """The received array; raises on timeout, mismatch or a failed peer."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Withdraw the receive if its payload has not started arriving."""


class Transport(abc.ABC):
    """Point-to-point messaging between the ranks of one job (see the module docstring).

    Attributes:
        timeout: seconds a send or receive waits when its call gives no timeout.
        stats: bytes and messages moved.
        groups: the collective groups open over this transport.
        topology: the node of every rank and what follows from it, once known.
    """

    def __init__(self, place: Place | None, *, timeout: float = DEFAULT_TIMEOUT):
        self._place = place
        self.timeout = timeout
        self.stats = TransportStats()
        self.groups = OpenGroups()
        self.topology = Topology()

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

    @property
    def who(self) -> str:
        """This rank, for messages ("rank 3")."""
        return f"rank {self._place.rank}" if self._place is not None else "a rank without a place"

    # ---- messaging ---------------------------------------------------------------------

    @abc.abstractmethod
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

    @abc.abstractmethod
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

    @abc.abstractmethod
    async def recv_any(
        self,
        *,
        tag: Tag,
        op: str = "p2p",
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> tuple[int, np.ndarray]:
        """Receive the next message with ``tag`` from any rank: (its rank, the array)."""

    def path_to(self, dst: int, nbytes: int) -> str:
        """The path a payload of ``nbytes`` to ``dst`` takes now ("memory", "tcp" or
        "shm"), for timelines."""
        return "memory"

    # ---- failure -----------------------------------------------------------------------

    @abc.abstractmethod
    def abort(self, exc: BaseException) -> None:
        """Poison the transport: pending and later calls raise ``exc``; every open group
        is told (``groups.aborted``)."""

    @abc.abstractmethod
    def poison_group(self, group: int, error: BaseException, members: Sequence[int]) -> None:
        """Fail every receive of ``group`` here, and tell its other ``members`` (all its
        ranks) to do the same."""

    @abc.abstractmethod
    def group_error(self, group: int) -> BaseException | None:
        """The error another member (or this rank) poisoned ``group`` with, if any."""

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """The error this transport was poisoned with, if any."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""

    def check_usable(self) -> None:
        """Raise why this transport cannot be used (its abort error, or closed)."""
        error = self.error
        if error is not None:
            raise error
        if self.closed:
            raise TransportClosed(f"{self.who}: transport is closed")

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every socket and task. Safe to call twice."""
