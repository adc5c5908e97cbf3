"""TCP peer mesh: one authenticated connection per pair of ranks that talk.

Theory of operation
-------------------
1. :meth:`TcpMesh.listen` binds a port (ephemeral, or of a range a firewall admits)
   before the worker joins: the port goes into the join, and all listen before any dial.
2. :meth:`TcpMesh.start` takes this rank's placement and an address book. Nothing is
   dialled then: a rank connects to a peer on its first send (``links``), so a rank
   holds connections only to the peers its collectives use. The dialer's handshake
   carries run id, generation and its rank, bound into the HMAC proofs. Handshakes that
   arrive before this rank has its placement are held.
3. Data frames are routed through the mailbox; payloads land directly in the receiving
   array. A connection lost without a goodbye poisons the mesh with ``PeerFailed``; after
   a goodbye (``Leave`` on the peer connection) only receives from that peer fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable, Sequence

import numpy as np

from shardwire.protocol import (
    ClientHandshake,
    JobAborted,
    PeerFailed,
    ProtocolError,
    ServerHandshake,
    ShardwireError,
    TensorMeta,
    TransportClosed,
)
from shardwire.protocol.control import message_bytes
from shardwire.protocol.decoder import StagePool
from shardwire.protocol.fields import TRACEBACK_CHARS
from shardwire.protocol.messages import Error, Failure, Hello, Leave
from shardwire.protocol.placement import Placement
from shardwire.worker.transport import tcptuning
from shardwire.worker.transport.arena_settings import CROWDED_NAP, ArenaSettings
from shardwire.worker.transport.book import AddressBook
from shardwire.worker.transport.dialing import CROSSED, Links
from shardwire.worker.transport.framing import HANG_UP_GRACE, Refused, open_connection
from shardwire.worker.transport.idle import IdleCloser
from shardwire.worker.transport.listen import bind_listener
from shardwire.worker.transport.mesh_config import MeshConfig
from shardwire.worker.transport.messaging import MailboxTransport
from shardwire.worker.transport.peer import PeerConnection
from shardwire.worker.transport.place import NodeMap, Place, Topology
from shardwire.worker.transport.poll import default_budget, usable_cpus
from shardwire.worker.transport.traffic import Traffic

_JOB_ABORTED = "job_aborted"  # Failure code: the sender stops because the job was aborted


# Accept queue of the peer listener (the kernel caps it at net.core.somaxconn).
BACKLOG = 4096


class TcpMesh(MailboxTransport):
    """The TCP transport: listen, take a place, then connect to peers on first use."""

    def __init__(
        self,
        config: MeshConfig,
        *,
        on_peer_failed: Callable[[PeerFailed], None] = lambda _err: None,
        **kwargs,
    ) -> None:
        super().__init__(None, **kwargs)  # the place comes with the placement
        self.config = config
        self._on_peer_failed = on_peer_failed
        self._server: asyncio.Server | None = None
        self._conns: dict[int, PeerConnection] = {}
        self.stages = StagePool()  # a stage per connection reading now, not per peer
        self.traffic = Traffic()  # what each peer link carried
        self._pending: list[PeerConnection] = []
        self._paused: set[PeerConnection] = set()
        self.links = Links(self)
        self.idle = IdleCloser(self, config.idle_close)
        self.book = AddressBook.fixed({})
        self.tcp = tcptuning.UNTUNED  # the peer connections' TCP settings, once listening
        self._closing = False
        self._reported_failure = False

    @property
    def has_place(self) -> bool:
        return self._place is not None

    @property
    def listen_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def listen(self, *, first: int = 0) -> int:
        """Bind the peer listener (``listen.py``: ``first`` is the local rank); its port."""
        self.tcp = tcptuning.plan(self.config.tcp_congestion, self.config.tcp_notsent_lowat)
        self._server = await bind_listener(
            self._accepted,
            self.config.bind_host,
            ports=self.config.listen_ports,
            first=first,
            ssl=self.config.tls_server,
            ssl_handshake_timeout=self.config.handshake_timeout if self.config.tls_server else None,
            backlog=BACKLOG,  # every higher rank dials at once
        )
        return self.listen_port

    def _accepted(self) -> asyncio.BaseProtocol:
        if len(self._pending) >= self.config.max_unauthenticated:
            return Refused()
        conn: PeerConnection | None = None

        def accept(hello: Hello) -> Error | None:
            assert conn is not None
            return self._check_hello(hello, conn)

        conn = PeerConnection(self, ServerHandshake(self.config.token, accept=accept))
        self._pending.append(conn)
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.handshake_timeout, self._handshake_expired, conn)
        return conn

    def _handshake_expired(self, conn: PeerConnection) -> None:
        if not conn.authenticated and not conn.closed.done():
            limit = self.config.handshake_timeout
            conn.fail(ProtocolError(f"no handshake from {conn.peer_host} within {limit:g} s"))

    def _check_hello(self, hello: Hello, conn: PeerConnection) -> Error | None:
        problem = ""
        if hello.role != "peer" or hello.run_id != self.config.run_id:
            problem = f"expected a peer of run {self.config.run_id!r}"
        elif hello.generation != self.generation:
            problem = f"generation {hello.generation} is stale, the job is at {self.generation}"
        elif not 0 <= hello.rank < self.world_size or hello.rank == self.rank:
            problem = f"rank {hello.rank} is not a peer of rank {self.rank}"
        elif self._holds(hello.rank) or self.links.refuses(hello.rank):
            why = f"rank {self.rank} is connected or connecting to rank {hello.rank} itself"
            return Error(code=CROSSED, message=why)
        if problem:
            return Error(code="bad_request", message=problem)
        conn.peer = hello.rank  # claimed, not yet proven: the handshake makes the link
        self.links.expect(hello.rank)
        return None

    def _holds(self, peer: int) -> bool:
        """A connection to ``peer`` is open and not being released."""
        conn = self._conns.get(peer)
        return conn is not None and not conn.releasing

    def start(
        self,
        placement: Placement,
        book: AddressBook,
        *,
        nodes: Sequence[Hashable] | None = None,
    ) -> None:
        """Take this rank's place; peers' addresses come from ``book`` when first needed.
        ``nodes`` gives each rank's node where ranks are not contiguous per node."""
        self._settle(Place(placement.rank, placement.world_size, placement.generation))
        self.book = book
        local, cpus = placement.local_world_size, usable_cpus()
        self.poll.budget = default_budget(local, cpus, self.config.busy_poll_us)
        crowded = self.poll.yield_cpu = local > cpus
        arena = None
        if self.config.arena:
            arena = ArenaSettings(
                self.config.run_id,
                self.config.arena_slot_bytes,
                spin=self.poll.budget,
                yield_cpu=crowded,
                nap=CROWDED_NAP if crowded else 0.0,
                peer_reads=self.config.arena_peer_reads,
            )
        if nodes is None:
            nodes = NodeMap(placement.local_world_size, placement.world_size)
        self.topology = Topology(nodes, crowded, arena, network=not placement.one_machine)
        for conn in list(self._pending):
            conn.release_held()
        self.idle.start()

    async def ensure(self, peers: Sequence[int]) -> None:
        """Connect to ``peers`` now (bounded by ``connect_timeout``), as a first send would."""
        missing = [p for p in peers if p not in self._conns]
        await asyncio.gather(*(self.links.wait(p) for p in missing))

    async def dial(self, peer: int, host: str, port: int) -> None:
        """One connection attempt to ``peer`` (its handshake included)."""
        shake = ClientHandshake(
            self.config.token,
            role="peer",
            run_id=self.config.run_id,
            rank=self.rank,
            generation=self.generation,
        )
        conn = await open_connection(
            lambda: PeerConnection(self, shake, peer=peer), host, port, ssl=self.config.tls_client
        )
        try:
            await conn.ready
        except asyncio.CancelledError:
            conn.close()
            raise

    def link_failed(self, error: ShardwireError) -> None:
        """A peer could not be connected: poison the mesh (blaming it, if unreachable)."""
        if self._closing or self.error is not None:
            return
        if isinstance(error, PeerFailed):
            self._on_peer_failed(error)
        self.abort(error)

    def register(self, conn: PeerConnection) -> None:
        if conn in self._pending:
            self._pending.remove(conn)
        self._conns[conn.peer] = conn
        nodes = self.topology.nodes
        if self.config.shm and nodes and nodes[conn.peer] == nodes[self.rank]:
            conn.shm.allow(self.config.run_id, self.config.shm_slots, self.config.shm_slot_bytes)
        self.links.connected(conn)

    def pause(self, conn: PeerConnection) -> None:
        self._paused.add(conn)

    def is_paused(self, conn: PeerConnection) -> bool:
        return conn in self._paused

    def connection(self, peer: int) -> PeerConnection | None:
        """The connection sends to ``peer`` go on now, if any."""
        return self._conns.get(peer)

    def forget(self, conn: PeerConnection) -> None:
        """Send nothing more on ``conn`` (released when idle); the next send dials."""
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]

    def handshaking(self) -> int:  # connections accepted whose peer has not proven itself
        return len(self._pending)

    def peers(self) -> list[int]:
        """The ranks this rank holds an open connection to (made on first use)."""
        return sorted(p for p, c in self._conns.items() if c.is_open)

    def shm_peers(self) -> list[int]:
        """The peers this rank sends large payloads to through shared memory."""
        return sorted(p for p, c in self._conns.items() if c.shm.out is not None)

    def path_to(self, dst: int, nbytes: int) -> str:
        conn = self._conns.get(dst)
        return "shm" if conn and conn.shm.out is not None and conn.shm.wants(nbytes) else "tcp"

    def lost(self, conn: PeerConnection, exc: Exception | None) -> None:
        self.idle.retired.discard(conn)
        if conn in self._pending:
            self._pending.remove(conn)
            if conn.peer >= 0 and not self._closing:  # an accepted hello, never proven
                self.links.inbound_failed(conn.peer)
        self._paused.discard(conn)
        if self._closing or self._conns.get(conn.peer) is not conn:
            return
        if conn.said_goodbye and conn.failure is None:
            self.depart(conn.peer, PeerFailed(rank=conn.peer, reason="rank left the job"))
            return
        if conn.failure is not None and conn.failure.code == _JOB_ABORTED:
            error = JobAborted(conn.failure.reason)
        elif conn.failure is not None and conn.failure.rank >= 0 and conn.failure.rank != self.rank:
            error = PeerFailed(  # the peer left because another rank failed
                rank=conn.failure.rank, reason=f"{conn.failure.reason} (seen by rank {conn.peer})"
            )
        elif conn.failure is not None:
            error = PeerFailed(
                rank=conn.peer,
                reason=conn.failure.reason,
                remote_traceback=conn.failure.traceback,
            )
        else:
            if conn.violation is not None:
                why = f"closed after a protocol violation: {conn.violation}"
            else:
                why = f"connection lost ({exc})" if exc else "connection closed without goodbye"
            error = PeerFailed(rank=conn.peer, reason=why)
        if self.error is None and isinstance(error, PeerFailed):
            self._on_peer_failed(error)
        self.abort(error)

    def _conn_to(self, dst: int) -> PeerConnection | None:  # None while there is none yet
        conn = self._conns.get(dst)
        if conn is not None and not conn.is_open:
            raise PeerFailed(rank=dst, reason="no open connection")
        return conn

    def _start_send(self, dst: int, meta: TensorMeta, array: np.ndarray) -> Awaitable[None] | None:
        conn = self._conn_to(dst)
        if conn is None:
            return self.links.send(dst, meta, array)
        return conn.outbox.send(meta, array)

    def post(self, dst: int, meta: TensorMeta, array: np.ndarray) -> None:
        conn = self._conn_to(dst)
        if conn is None:
            self.links.post(dst, meta, array)
        else:
            conn.outbox.post(meta, array)

    def report_failure(self, reason: str, traceback: str) -> None:
        """Tell every peer why this rank is about to go away."""
        self._reported_failure = True
        msg = Failure(reason=reason[:4096], traceback=traceback[-TRACEBACK_CHARS:])
        for conn in self._conns.values():
            conn.write_message(msg)

    def _posted(self, src: int) -> None:
        conn = self._conns.get(src)
        if conn is not None:
            conn.settle()  # a payload that waited for this receive goes on (else nothing)

    def _resume(self) -> None:
        for conn in self._paused:
            if conn.transport is not None and not conn.transport.is_closing():
                conn.transport.resume_reading()
        self._paused.clear()

    def _on_abort(self) -> None:
        self._closing = True
        # Say which rank failed before hanging up, so that a peer which sees this
        # connection close first does not blame this rank for it.
        error = self.error
        last = b""
        if isinstance(error, JobAborted) and not self._reported_failure:
            self._reported_failure = True
            if isinstance(error, PeerFailed):
                why = Failure(rank=error.rank, reason=error.reason[:4096])
            else:  # the coordinator is gone: say so rather than look like a failure
                why = Failure(rank=self.rank, reason=str(error)[:4096], code=_JOB_ABORTED)
            last = message_bytes(why)
        for conn in list(self._conns.values()):
            conn.hang_up(last)
        self.links.stop(error or JobAborted("the transport was aborted"))

    async def _close(self) -> None:
        self._closing = True
        await self.idle.aclose()
        await self.links.aclose(self.error or TransportClosed(f"{self.who}: transport closed"))
        await self.book.aclose()
        conns = [*self._conns.values(), *self._pending, *self.idle.retired]
        goodbye = b"" if self._reported_failure else message_bytes(Leave())
        for conn in self._conns.values():
            conn.hang_up(goodbye)
        for conn in self._pending:
            conn.close()
        if self._server is not None:
            self._server.close()
        # each peer closes its side, or grace ends; a connection whose TLS handshake never
        # completed was never made (asyncio does not tell its protocol): nothing to wait for
        made = [c for c in conns if c.transport is not None]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HANG_UP_GRACE + 0.5):
                await asyncio.gather(*(asyncio.shield(c.closed) for c in made))
        for conn in conns:
            conn.close()
        writers = [c.outbox.task for c in conns if c.outbox.task is not None]
        for task in writers:  # each ends by itself once its connection is closed
            task.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
