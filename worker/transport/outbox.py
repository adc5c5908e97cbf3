"""Writing one peer connection's frames: whole, in order, checksummed while in cache.

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
from typing import TYPE_CHECKING

import numpy as np

from shardwire.protocol import TensorMeta
from shardwire.protocol.frames import encode_data_head, encode_sealed_head
from shardwire.worker.transport.mailbox import byte_view

if TYPE_CHECKING:
    from shardwire.worker.transport.peer import PeerConnection

# Below this size prefix, meta and payload go out as one write (one syscall); above it
# the payload is written from the caller's array without a copy.
_COALESCE_BYTES = 64 * 1024
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
        self._conn.moves += 1
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
        self._conn.moves += 1
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
                    self._conn.count_sent("shm", item.nbytes)
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
            if self._conn.retiring:
                self._conn.hang_up()

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
        self._conn.count_sent("tcp", array.nbytes)
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
        self._conn.count_sent("tcp", array.nbytes)
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
