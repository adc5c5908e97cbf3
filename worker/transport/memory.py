"""In-process transport: N endpoints in one event loop, same contract as the TCP mesh."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import numpy as np

from shardwire.protocol import PeerFailed, TensorMeta
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.transport.base import DEFAULT_TIMEOUT
from shardwire.worker.transport.messaging import MailboxTransport
from shardwire.worker.transport.place import Place


class MemoryHub:
    """Connects ``world_size`` :class:`MemoryTransport` endpoints.

    Example::

        hub = MemoryHub(4)
        transports = [hub.endpoint(r) for r in range(4)]
    """

    def __init__(
        self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT, max_early_bytes: int = 1 << 30
    ):
        self.world_size = world_size
        self._timeout = timeout
        self._max_early = max_early_bytes
        self._endpoints: dict[int, MemoryTransport] = {}
        # Every pair of ranks that exchanged a message: the connections a TCP mesh would
        # have opened for the same traffic (it connects on first use).
        self.pairs: set[tuple[int, int]] = set()

    def links(self, rank: int) -> int:
        """How many peers ``rank`` has exchanged messages with."""
        return sum(1 for pair in self.pairs if rank in pair)

    def endpoint(self, rank: int) -> MemoryTransport:
        if rank in self._endpoints:
            raise InvalidArgument(f"rank {rank} already has an endpoint")
        ep = MemoryTransport(self, rank, timeout=self._timeout, max_early_bytes=self._max_early)
        self._endpoints[rank] = ep
        return ep

    def peer(self, rank: int) -> MemoryTransport:
        return self._endpoints[rank]

    def kill(self, rank: int, reason: str = "killed") -> None:
        """Simulate the death of ``rank``: every other endpoint is aborted."""
        error = PeerFailed(rank=rank, reason=reason)
        for r, ep in self._endpoints.items():
            if r != rank:
                ep.abort(error)


class MemoryTransport(MailboxTransport):
    """One rank's endpoint on a :class:`MemoryHub`."""

    def __init__(self, hub: MemoryHub, rank: int, **kwargs) -> None:
        super().__init__(Place(rank, hub.world_size), **kwargs)
        self.hub = hub  # the world this endpoint is part of (tests kill ranks through it)
        self._space = asyncio.Event()
        self._space.set()

    def _start_send(self, dst: int, meta: TensorMeta, array: np.ndarray) -> Awaitable[None] | None:
        self.hub.pairs.add((min(self.rank, dst), max(self.rank, dst)))
        peer = self.hub.peer(dst)
        if peer.closed:
            raise PeerFailed(rank=dst, reason="endpoint closed")
        if peer.mailbox.over_budget:
            return self._deliver_later(peer, meta, array)
        peer.mailbox.deliver(meta, array)
        return None

    def post(self, dst: int, meta: TensorMeta, array: np.ndarray) -> None:
        self.hub.pairs.add((min(self.rank, dst), max(self.rank, dst)))
        self.hub.peer(dst).mailbox.deliver(meta, array)

    async def _deliver_later(
        self, peer: MemoryTransport, meta: TensorMeta, array: np.ndarray
    ) -> None:
        while peer.mailbox.over_budget:  # backpressure, like a full socket buffer
            await peer.space()
            self.check_usable()
        peer.mailbox.deliver(meta, array)

    async def space(self) -> None:
        """Return once this endpoint's early-arrival backlog drained below its budget (or
        it was aborted or closed)."""
        self._space.clear()
        await self._space.wait()

    def _resume(self) -> None:
        self._space.set()

    def _on_abort(self) -> None:
        self._space.set()

    async def _close(self) -> None:
        self._space.set()
