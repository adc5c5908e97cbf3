"""One peer connection: data frames in (into posted receives, checksums verified) and
out (whole frames, in order, checksummed while in cache).

Theory of operation
-------------------
Receiving: the frame decoder asks :meth:`PeerConnection._allocate` where a payload goes;
the mailbox answers with the posted receive's array, or scratch space for an early
arrival. A large payload nobody waits for yet makes the connection stop reading for one
loop turn, since its receive is usually about to be posted.

Sending: :class:`Outbox` writes each frame whole. Frames up to 8 MiB, and every frame
without a checksum, go to the transport at once while nothing else is being written (the
caller's array is written without a copy and the send completes when the kernel has it;
a checksum is computed first, from cache). A larger frame with a checksum is streamed:
each slice is hashed just before it is handed to the kernel, and the next slice waits
until the previous one is in the kernel, so the hash reads warm data and overlaps the
peer's receive. While a frame streams, later frames and control
messages queue behind it, which keeps every frame contiguous on the wire.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

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
from shardwire.protocol.frames import encode_data_head, encode_sealed_head
from shardwire.protocol.integrity import integrity_error
from shardwire.protocol.messages import Failure, Leave, Message, ShmAnswer, ShmOffer
from shardwire.worker.transport.framing import HANG_UP_GRACE, FramedProtocol
from shardwire.worker.transport.mailbox import Inbound, Mailbox, byte_view
from shardwire.worker.transport.shmlink import ShmLink

if TYPE_CHECKING:
    from shardwire.worker.transport.mesh import MeshConfig

# Below this size prefix, meta and payload go out as one write (one syscall); above it
# the payload is written from the caller's array without a copy.
_COALESCE_BYTES = 64 * 1024
# Payloads at least this large wait (one loop turn) for their receive to be posted
# rather than being read into scratch space: at 1 MiB this took p2p throughput on
# loopback from ~3.3 to ~13 GB/s (scratch allocation page faults plus a second copy).
_DEFER_BYTES = 64 * 1024
# Checksummed payloads above _STREAM_BYTES are streamed in slices of _SLICE_BYTES; smaller
# ones are hashed whole (from cache: xxh3 runs at ~58 GB/s on 1 MiB here) and written at
# once, which costs less than a background writer would.
_STREAM_BYTES = 8 << 20
_SLICE_BYTES = 1 << 20


@dataclass(slots=True)
class _Queued:
    meta: TensorMeta | None  # None: a control frame's bytes
    item: np.ndarray | bytes
    future: asyncio.Future[None] | None  # None: nobody waits for it
    shm: bool = False  # the payload goes through shared memory


class Outbox:
    """Writes whole frames to one connection in order (see the module docstring)."""

    def __init__(self, conn: PeerConnection, *, checksum: bool):
        self._conn = conn
        self._checksum = checksum
        self._queue: deque[_Queued] = deque()
        self.streaming = False  # a frame is being written in slices
        self.task: asyncio.Task[None] | None = None  # owned; ends when the queue is empty

    def send(self, meta: TensorMeta, array: np.ndarray) -> Awaitable[None] | None:
        """Write a data frame; returns what to await until ``array`` may change, if any."""
        if self._conn.shm.wants(array.nbytes):
            future = asyncio.get_running_loop().create_future()
            self._queue.append(_Queued(meta, array, future, shm=True))
            self._start()
            return future
        if self.task is None and (not self._checksum or array.nbytes <= _STREAM_BYTES):
            self._write_now(meta, array)
            return self._conn.wait_flushed() if self._buffered() else None
        future = asyncio.get_running_loop().create_future()
        self._enqueue(meta, array, future)
        return future

    def post(self, meta: TensorMeta, array: np.ndarray) -> None:
        """Write a small data frame nobody waits on (after whatever is queued)."""
        assert array.nbytes <= _COALESCE_BYTES
        if self.task is None:
            self._write_now(meta, array)
        else:
            self._enqueue(meta, array.copy(), None)

    def urgent(self, data: bytes) -> None:
        """Write a frame that must not wait behind this rank's own sends (a shared-memory
        credit, offer or answer) now, or right after the frame being written in slices."""
        if self.streaming:
            self._enqueue(None, data, None)
        elif self._conn.is_open:
            assert self._conn.transport is not None
            self._conn.transport.write(data)

    def write(self, data: bytes) -> None:
        """Write a control frame (after whatever is queued)."""
        if self.task is None:
            if self._conn.is_open:
                assert self._conn.transport is not None
                self._conn.transport.write(data)
        else:
            self._enqueue(None, data, None)

    def stop(self, exc: BaseException) -> None:
        """Drop the unsent queue, failing its senders with ``exc``, and end the writer.
        (Failed here, not by the writer: a writer cancelled before its first step never
        runs its own clean-up.)"""
        self._fail_all(None, exc)
        if self.task is not None:
            self.task.cancel()

    # ---- internals --------------------------------------------------------------------

    def _buffered(self) -> int:
        transport = self._conn.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def _enqueue(
        self, meta: TensorMeta | None, item: np.ndarray | bytes, future: asyncio.Future | None
    ) -> None:
        self._queue.append(_Queued(meta, item, future))
        self._start()

    def _start(self) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._drain(), name=f"outbox-{self._conn.peer}")

    async def _drain(self) -> None:
        current: _Queued | None = None
        try:
            while self._queue:
                current = queued = self._queue.popleft()
                meta, item = queued.meta, queued.item
                if isinstance(item, bytes):
                    if self._conn.is_open:
                        assert self._conn.transport is not None
                        self._conn.transport.write(item)
                elif meta is not None and queued.shm and await self._conn.shm.ready():
                    await self._conn.shm.send(meta, item)
                elif meta is not None and self._checksum and item.nbytes > _STREAM_BYTES:
                    await self._stream(meta, item)
                elif meta is not None:
                    self._write_now(meta, item)
                if self._buffered():
                    await self._conn.wait_flushed()
                if queued.future is not None and not queued.future.done():
                    queued.future.set_result(None)
                current = None
        except (ConnectionError, OSError) as exc:
            self._fail_all(current, exc)
        except asyncio.CancelledError:
            self._fail_all(current, ConnectionResetError("connection closed while sending"))
            raise
        finally:
            self.task = None

    def _fail_all(self, current: _Queued | None, exc: BaseException) -> None:
        items = ([current] if current is not None else []) + list(self._queue)
        self._queue.clear()
        for queued in items:
            if queued.future is not None and not queued.future.done():
                queued.future.set_exception(exc)

    def _write_now(self, meta: TensorMeta, array: np.ndarray) -> None:
        if not self._conn.is_open:
            raise ConnectionResetError("connection closed while sending")
        transport = self._conn.transport
        assert transport is not None
        payload = byte_view(array)
        if not self._checksum:
            head = encode_data_head(meta, array.nbytes)
            if array.nbytes <= _COALESCE_BYTES:
                transport.write(head + payload)  # one syscall; the bytes are copied
            else:
                transport.write(head)
                transport.write(payload)
            return
        head, digest = encode_sealed_head(meta, array.nbytes)
        digest.update(payload)
        if array.nbytes <= _COALESCE_BYTES:
            transport.write(head + payload + digest.digest())
        else:
            transport.write(head)
            transport.write(payload)
            transport.write(digest.digest())

    async def _stream(self, meta: TensorMeta, array: np.ndarray) -> None:
        if not self._conn.is_open:
            raise ConnectionResetError("connection closed while sending")
        transport = self._conn.transport
        assert transport is not None
        payload = byte_view(array)
        head, digest = encode_sealed_head(meta, array.nbytes)
        self.streaming = True
        try:
            transport.write(head)
            for start in range(0, len(payload), _SLICE_BYTES):
                piece = payload[start : start + _SLICE_BYTES]
                digest.update(piece)
                transport.write(piece)
                if self._buffered():
                    await self._conn.wait_flushed()
            transport.write(digest.digest())
        finally:
            self.streaming = False


class PeerOwner(Protocol):
    """What a peer connection needs from the mesh that owns it."""

    config: MeshConfig
    mailbox: Mailbox
    stages: StagePool  # staging buffers shared by the connections

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
        self._inbound: deque[Inbound] = deque()
        self._deferred: TensorMeta | None = None
        self.outbox = Outbox(self, checksum=mesh.config.checksum)
        self.shm = ShmLink(self)

    def _authenticated(self) -> None:
        if isinstance(self._shake, ServerHandshake):
            assert self._shake.hello is not None
            self.peer = self._shake.hello.rank
        self.mesh.register(self)

    def tensor_meta(self, meta: dict, payload_len: int | None) -> TensorMeta:
        """Check a data frame's meta (``payload_len`` None: its bytes come through
        shared memory, bounded like a payload)."""
        if not self.authenticated:
            raise ProtocolError("data frame before the handshake finished")
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
        return byte_view(inbound.array)

    def settle(self) -> None:
        """Give a deferred payload its destination (the posted receive, or scratch)."""
        meta, self._deferred = self._deferred, None
        if meta is None or not self.is_open:
            return
        try:
            self._decoder.resume(self._destination(meta))
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
        if len(frame.payload):
            inbound = self._inbound.popleft()
        elif self.authenticated and self.shm.on_frame(frame.meta):
            return
        else:  # zero-byte payloads skip the allocator
            inbound = self.mesh.mailbox.begin(self.tensor_meta(frame.meta, 0))
        if frame.intact is False or (frame.intact is None and self.mesh.config.checksum):
            missing = frame.intact is None
            error = integrity_error(inbound.meta, rank=self.mesh.rank, missing=missing)
            self.mesh.mailbox.reject(inbound, error)
            return
        self.finish_inbound(inbound)

    def finish_inbound(self, inbound: Inbound) -> None:
        """A message is complete: hand it over; stop reading while over budget."""
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
        raise ProtocolError(f"unexpected {msg.kind!r} on a peer connection")

    def write_message(self, msg: Message) -> None:
        self.outbox.write(message_bytes(msg))

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
        while self._inbound:
            self.mesh.mailbox.abandon(self._inbound.popleft(), why)
        self.shm.close(why)
