"""One peer connection: data frames in (into posted receives, checksums verified) and
out (whole frames, in order, checksummed while in cache).

Theory of operation
-------------------
Receiving: the frame decoder asks :meth:`PeerConnection._allocate` where a payload goes;
the mailbox answers with the posted receive's array, or scratch space for an early
arrival. A large payload nobody waits for yet makes the connection stop reading for one
loop turn, since its receive is usually about to be posted.
Sending is the outbox's (``transport.outbox``); closing an idle connection is
``transport.idle``'s.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from shardwire.protocol import (
    Frame,
    Header,
    Limits,
    ProtocolError,
    ServerHandshake,
    ShardwireError,
    TensorMeta,
    message_bytes,
    parse_tensor_meta,
)
from shardwire.protocol.decoder import StagePool
from shardwire.protocol.integrity import integrity_error
from shardwire.protocol.messages import (
    Failure,
    Leave,
    Message,
    Release,
    ReleaseAnswer,
    ShmAnswer,
    ShmOffer,
)
from shardwire.worker.transport import tcptuning
from shardwire.worker.transport.framing import HANG_UP_GRACE, FramedProtocol
from shardwire.worker.transport.mailbox import Inbound, Mailbox, byte_view
from shardwire.worker.transport.outbox import Outbox
from shardwire.worker.transport.shmlink import ShmLink
from shardwire.worker.transport.traffic import RTT_EVERY, TIMED_BYTES, Path, Traffic, kernel_rtt_us

if TYPE_CHECKING:
    from shardwire.worker.transport.idle import IdleCloser
    from shardwire.worker.transport.mesh_config import MeshConfig

# Payloads at least this large wait (one loop turn) for their receive to be posted
# rather than being read into scratch space: at 1 MiB this took p2p throughput on
# loopback from ~3.3 to ~13 GB/s (scratch allocation page faults plus a second copy).
_DEFER_BYTES = 64 * 1024


class PeerOwner(Protocol):
    """What a peer connection needs from the mesh that owns it."""

    config: MeshConfig
    mailbox: Mailbox
    stages: StagePool  # staging buffers shared by the connections
    traffic: Traffic  # what each peer link carried
    idle: IdleCloser  # releases connections nothing moved on
    tcp: tcptuning.TcpPlan  # the TCP settings each connection gets, by its addresses

    @property
    def has_place(self) -> bool: ...

    @property
    def rank(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def error(self) -> BaseException | None: ...

    def register(self, conn: PeerConnection) -> None:
        """The handshake finished: ``conn`` carries ``conn.peer``'s frames."""

    def lost(self, conn: PeerConnection, exc: Exception | None) -> None:
        """``conn`` closed (``exc``: why, if not cleanly)."""

    def pause(self, conn: PeerConnection) -> None:
        """``conn`` stopped reading: early arrivals are over budget."""

    def is_paused(self, conn: PeerConnection) -> bool: ...


class PeerConnection(FramedProtocol):
    """A connection to one peer rank, carrying data frames after the handshake."""

    def __init__(self, mesh: PeerOwner, handshake, *, peer: int = -1):
        super().__init__(
            handshake,
            limits=Limits(max_payload=mesh.config.max_payload),
            on_message=self._on_control,
            hold_handshake=lambda: not mesh.has_place,
            stages=mesh.stages,
        )
        self.mesh = mesh
        self.peer = peer
        self.said_goodbye = False
        self.failure: Failure | None = None
        self.moves = 0  # data frames in and out (idle detection)
        self.releasing = False  # this rank proposed closing it for idleness
        self.retiring = False  # released: hang up once the queued frames are out
        self._inbound: deque[Inbound] = deque()
        self._began: deque[float] = deque()  # when each of _inbound's payloads began (0: untimed)
        self._rtt_due = 0.0  # when the connection's round-trip time is sampled next
        self._deferred: TensorMeta | None = None
        self.outbox = Outbox(self, checksum=mesh.config.checksum)
        self.shm = ShmLink(self)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.socket is not None:  # the plan was made when the mesh began to listen
            try:
                tcptuning.tune(self.socket, self.mesh.tcp)
            except OSError as exc:
                self.fail(exc)

    @property
    def accepted(self) -> bool:
        """Whether the peer dialled this rank (else this rank dialled it)."""
        return isinstance(self.session.handshake, ServerHandshake)

    def _authenticated(self) -> None:
        shake = self.session.handshake
        if isinstance(shake, ServerHandshake):  # accepted: the hello named the rank
            assert shake.hello is not None
            self.peer = shake.hello.rank
        self.mesh.register(self)

    def tensor_meta(self, meta: dict, payload_len: int | None) -> TensorMeta:
        """Check a data frame's meta (``payload_len`` None: its bytes come through
        shared memory, bounded like a payload). Data frames reach it only once the
        peer is authenticated: the session lets none through before."""
        tm = parse_tensor_meta(meta, payload_len)
        if payload_len is None and tm.nbytes > self.mesh.config.max_payload:
            raise ProtocolError(f"rank {tm.src} announces {tm.nbytes} bytes through shared memory")
        if tm.src != self.peer or tm.generation != self.mesh.generation:
            raise ProtocolError(
                f"data frame claims rank {tm.src} generation {tm.generation} on the "
                f"connection of rank {self.peer} generation {self.mesh.generation}"
            )
        return tm

    def _allocate(self, header: Header) -> memoryview | None:
        meta = self.tensor_meta(header.meta, header.payload_len)
        if header.payload_len >= _DEFER_BYTES and not self.mesh.mailbox.has_posted(meta):
            # Nobody waits for this payload yet. Usually the receive is one loop turn
            # away (its task was just woken), so stop reading until then instead of
            # landing the payload in a scratch array and copying it again later.
            self._deferred = meta
            assert self.transport is not None
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self.settle)
            return None
        return self._destination(meta)

    def _destination(self, meta: TensorMeta) -> memoryview:
        # The decoder may parse several headers before it hands over their frames, so
        # destinations queue up in arrival order.
        inbound = self.mesh.mailbox.begin(meta)
        self._inbound.append(inbound)
        self._began.append(time.monotonic() if meta.nbytes >= TIMED_BYTES else 0.0)
        return byte_view(inbound.array)

    def settle(self) -> None:
        """Give a deferred payload its destination (the posted receive, or scratch)."""
        meta, self._deferred = self._deferred, None
        if meta is None or not self.is_open:
            return
        try:
            self.session.resume(self._destination(meta))
        except ShardwireError as exc:
            self.fail(exc)
            return
        self.drain_frames()
        if self.is_open and self._deferred is None and not self.mesh.is_paused(self):
            assert self.transport is not None
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._deferred is not None and self.is_open:  # the loop read on while we deferred
            self.settle()
        return super().get_buffer(sizehint)

    def _on_data(self, frame: Frame) -> None:
        self.moves += 1
        began = 0.0
        if len(frame.payload):
            inbound = self._inbound.popleft()
            began = self._began.popleft()
        elif self.shm.on_frame(frame.meta):
            return
        else:  # zero-byte payloads skip the allocator
            inbound = self.mesh.mailbox.begin(self.tensor_meta(frame.meta, 0))
        if frame.intact is False or (frame.intact is None and self.mesh.config.checksum):
            missing = frame.intact is None
            error = integrity_error(inbound.meta, rank=self.mesh.rank, missing=missing)
            self.mesh.mailbox.reject(inbound, error)
            return
        self.finish_inbound(inbound, "tcp", time.monotonic() - began if began else None)

    def finish_inbound(self, inbound: Inbound, path: Path, seconds: float | None = None) -> None:
        """A message is complete (through ``path``; its payload took ``seconds``, if
        timed): count it, hand it over, stop reading while over budget."""
        self.mesh.traffic.received(self.peer, path, inbound.meta.nbytes, seconds)
        self.mesh.mailbox.finish(inbound)
        if self.mesh.mailbox.over_budget and self.transport is not None:
            self.transport.pause_reading()
            self.mesh.pause(self)

    def _on_control(self, msg: Message) -> None:
        if isinstance(msg, Leave):
            self.said_goodbye = True
            return
        if isinstance(msg, Failure):
            self.failure = msg
            return
        if isinstance(msg, ShmOffer):  # answered at once: this rank's sends may wait on ours
            self.outbox.urgent(message_bytes(self.shm.on_offer(msg, self.mesh.config.run_id)))
            return
        if isinstance(msg, ShmAnswer):
            self.shm.on_answer(msg)
            return
        if isinstance(msg, Release | ReleaseAnswer):
            self.mesh.idle.on_message(self, msg)
            return
        raise ProtocolError(f"unexpected {msg.kind!r} on a peer connection")

    def count_sent(self, path: Path, nbytes: int) -> None:
        """A payload went out through ``path``; the connection's round-trip time is
        read from the kernel at most every RTT_EVERY seconds of sending."""
        traffic = self.mesh.traffic
        traffic.sent(self.peer, path, nbytes)
        now = time.monotonic()
        if now >= self._rtt_due:
            self._rtt_due = now + RTT_EVERY
            traffic.round_trip(self.peer, kernel_rtt_us(self.socket))

    def write_message(self, msg: Message) -> None:
        self.outbox.write(message_bytes(msg))

    def quiet(self) -> bool:
        """Nothing is moving on this connection or about to (frames, payloads, shared
        memory): it may be released for idleness."""
        transport = self.transport
        return (
            self.is_open
            and self.outbox.task is None
            and transport is not None
            and not transport.get_write_buffer_size()
            and not self._inbound
            and self._deferred is None
            and not self.shm.in_use
        )

    def retire(self) -> None:
        """Hang up once the frames queued now are out (the connection was released)."""
        self.retiring = True
        if self.outbox.task is None:
            self.hang_up()

    def hang_up(self, last: bytes = b"", *, grace: float = HANG_UP_GRACE) -> None:
        """Stop sending and hang up (see :meth:`FramedProtocol.hang_up`); ``last`` goes
        out after the frames already handed to the socket, ahead of the unsent queue,
        which is dropped. A frame being written in slices cannot be cut: then the
        connection just closes."""
        if self.outbox.streaming:
            self.close()
            return
        self.outbox.stop(ConnectionResetError("connection closed while sending"))
        super().hang_up(last, grace=grace)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.mesh.lost(self, exc)
        # Receives whose payload was arriving on this connection can never complete.
        why = self.mesh.error or ConnectionResetError(
            f"connection to rank {self.peer} lost in the middle of a message"
        )
        self._began.clear()
        while self._inbound:
            self.mesh.mailbox.abandon(self._inbound.popleft(), why)
        self.shm.close(why)
