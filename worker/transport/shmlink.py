"""Shared memory on one peer connection (see :mod:`shardwire.worker.transport.shm`).

A :class:`ShmLink` belongs to one :class:`PeerConnection`. Nothing is created when the
connection opens: the first payload large enough for shared memory (``wants``) to a
peer on the same node makes the sender offer the segment this rank sends through
(``ready``: offer, then wait for ``on_answer``); the peer attaches it (``on_offer``).
Collectives on one node run on the node arena, so a job that only runs collectives
creates no segment at all, and /dev/shm holds segments only for the pairs that
exchange large point-to-point payloads. A refused or failed offer keeps that direction
on TCP for the connection's life. On the connection, besides ordinary data frames,
three small frames without payload bytes carry the shared-memory traffic:

* a message head: the tensor meta plus ``shm: 1``; its bytes follow through slots;
* a chunk: ``c: [slot, length]``, the next ``length`` bytes of the message in ``slot``;
* a credit: ``f: slot``, sent back once the receiver has copied the slot out.

Heads and chunks are written in order by the connection's outbox, so a message's chunks
are never interleaved with another message's frames. Credits are written at once (they
are whole frames), so two ranks sending to each other never wait on each other's queue.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from shardwire.protocol import FrameKind, ProtocolError, TensorMeta, encode_head
from shardwire.protocol.control import message_bytes
from shardwire.protocol.frames import encode_data_head
from shardwire.protocol.messages import ShmAnswer, ShmOffer
from shardwire.worker.transport.mailbox import byte_view
from shardwire.worker.transport.shm import Segment, SlotPool

if TYPE_CHECKING:
    from shardwire.worker.transport.peer import PeerConnection

log = logging.getLogger("shardwire.worker")

# Payloads at least this large go through shared memory once a segment is accepted;
# smaller ones stay in the connection's frames (one write, no slot round trip).
SHM_MIN_BYTES = 128 * 1024
SHM_KEY, CHUNK_KEY, CREDIT_KEY = "shm", "c", "f"
_SHM_HEAD = ((SHM_KEY, 1),)


class ShmLink:
    def __init__(self, conn: PeerConnection) -> None:
        self._conn = conn
        self.out: SlotPool | None = None  # the segment this rank sends through
        self.inbox: Segment | None = None  # the peer's segment this rank receives from
        self._offered: Segment | None = None
        self._current: list[Any] | None = None  # [Inbound, bytes filled]
        # (run id, slots, slot bytes) while an offer may still be made to a same-node peer
        self._terms: tuple[str, int, int] | None = None
        self._answer: asyncio.Future[None] | None = None  # the offer's answer, once offered

    @property
    def in_use(self) -> bool:
        """A segment is offered or attached in either direction."""
        return self.out is not None or self.inbox is not None or self._offered is not None

    # ---- negotiation ---------------------------------------------------------------

    def allow(self, run_id: str, slots: int, slot_bytes: int) -> None:
        """The peer shares this node: the first large payload will offer a segment."""
        self._terms = (run_id, slots, slot_bytes)

    async def ready(self) -> bool:
        """Whether this direction's payload goes through shared memory: offers the segment
        on the first call and waits (at most the connect timeout) for the peer's answer."""
        timeout = self._conn.mesh.config.connect_timeout
        if self._terms is not None:
            terms, self._terms = self._terms, None
            self._answer = asyncio.get_running_loop().create_future()
            self._offer(*terms)
        if self._answer is None or self._answer.done():
            return self.out is not None
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._answer)
        except TimeoutError:
            raise ConnectionResetError(
                f"rank {self.peer} did not answer the shared-memory offer within {timeout:g} s"
            ) from None
        return self.out is not None

    def _offer(self, run_id: str, slots: int, slot_bytes: int) -> None:
        """Create this direction's segment and offer it to the peer."""
        try:
            segment, nonce = Segment.create(run_id, slots, slot_bytes)
        except OSError as exc:
            log.info("rank %d: no shared memory with rank %d: %s", self._rank, self.peer, exc)
            self._settle()
            return
        self._offered = segment
        offer = ShmOffer(
            name=segment.path.name, slots=slots, slot_bytes=slot_bytes, nonce=nonce.hex()
        )
        self._conn.outbox.urgent(message_bytes(offer))

    def on_offer(self, msg: ShmOffer, run_id: str) -> ShmAnswer:
        """The peer offers its segment: attach it if it is the one offered."""
        if self.inbox is not None:
            raise ProtocolError(f"rank {self.peer} offered a second shared-memory segment")
        try:
            nonce = bytes.fromhex(msg.nonce)
            self.inbox = Segment.attach(
                run_id, msg.name, slots=msg.slots, slot_bytes=msg.slot_bytes, nonce=nonce
            )
        except (OSError, ProtocolError) as exc:
            return ShmAnswer(ok=False, reason=str(exc)[:8192])
        return ShmAnswer(ok=True)

    def on_answer(self, msg: ShmAnswer) -> None:
        segment, self._offered = self._offered, None
        if segment is None:
            raise ProtocolError(f"rank {self.peer} answered a shared-memory offer never made")
        segment.unlink()  # both sides have it mapped (or it is refused): drop the name
        if msg.ok:
            self.out = SlotPool(segment)
        else:
            segment.close()
            log.info(
                "rank %d: rank %d refused shared memory: %s", self._rank, self.peer, msg.reason
            )
        self._settle()

    def _settle(self) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(None)

    @property
    def peer(self) -> int:
        return self._conn.peer

    @property
    def _rank(self) -> int:
        return self._conn.mesh.rank

    # ---- sending ---------------------------------------------------------------------

    def wants(self, nbytes: int) -> bool:
        """A payload this large may go through shared memory (``ready`` decides)."""
        if nbytes < SHM_MIN_BYTES:
            return False
        pending = self._answer is not None and not self._answer.done()
        return self.out is not None or self._terms is not None or pending

    async def send(self, meta: TensorMeta, array: np.ndarray) -> None:
        """Announce the message, then pass its bytes through free slots, in order."""
        pool = self.out
        assert pool is not None
        payload = byte_view(array)
        self._write(encode_data_head(meta, 0, _SHM_HEAD))
        step = pool.segment.slot_bytes
        for start in range(0, len(payload), step):
            piece = payload[start : start + step]
            slot = await pool.acquire()
            with pool.segment.slot(slot, len(piece)) as view:
                view[:] = piece
            self._write(encode_head(FrameKind.DATA, {CHUNK_KEY: [slot, len(piece)]}, 0))

    def _write(self, frame: bytes) -> None:
        conn = self._conn
        if not conn.is_open or conn.transport is None:
            raise ConnectionResetError(f"connection to rank {self.peer} closed while sending")
        conn.transport.write(frame)

    # ---- receiving -------------------------------------------------------------------

    def on_frame(self, meta: dict[str, Any]) -> bool:
        """Handle a shared-memory frame; False if ``meta`` is not one."""
        if CHUNK_KEY in meta:
            self._chunk(meta[CHUNK_KEY])
        elif CREDIT_KEY in meta:
            if self.out is None:
                raise ProtocolError(f"rank {self.peer} sent a credit without a segment")
            self.out.release(meta[CREDIT_KEY])
        elif meta.get(SHM_KEY) == 1:
            self._head(meta)
        else:
            return False
        return True

    def _head(self, meta: dict[str, Any]) -> None:
        if self.inbox is None:
            raise ProtocolError(f"rank {self.peer} sent a shared-memory message without a segment")
        if self._current is not None:
            raise ProtocolError(f"rank {self.peer} began a message inside another")
        tm = self._conn.tensor_meta(meta, None)
        inbound = self._conn.mesh.mailbox.begin(tm)
        if tm.nbytes == 0:
            self._conn.finish_inbound(inbound, "shm")
        else:
            self._current = [inbound, 0]

    def _chunk(self, value: Any) -> None:
        if self._current is None or self.inbox is None:
            raise ProtocolError(f"rank {self.peer} sent a shared-memory chunk outside a message")
        if not (isinstance(value, list) and len(value) == 2):
            raise ProtocolError(f"rank {self.peer} sent a malformed shared-memory chunk")
        slot, length = value
        inbound, filled = self._current
        target = byte_view(inbound.array)
        with self.inbox.slot(slot, length) as source:  # checks slot and length
            if filled + length > len(target):
                raise ProtocolError(
                    f"rank {self.peer}: shared-memory chunk of {length} bytes overruns the "
                    f"{len(target)}-byte message at {filled}"
                )
            item = inbound.array.itemsize
            if inbound.foldable and self.inbox.slot_bytes % item == 0:
                # reduce straight out of the slot: no copy into the receive buffer
                if filled % item or length % item:
                    raise ProtocolError(f"rank {self.peer} sent a chunk that splits an element")
                piece = np.frombuffer(source, dtype=inbound.array.dtype)
                inbound.posted.fold(piece, filled // item)
                inbound.folded = True
            else:
                target[filled : filled + length] = source
        self._conn.outbox.urgent(encode_head(FrameKind.DATA, {CREDIT_KEY: slot}, 0))
        filled += length
        if filled == len(target):
            self._current = None
            self._conn.finish_inbound(inbound, "shm")
        else:
            self._current[1] = filled

    # ---- end -----------------------------------------------------------------------

    def close(self, exc: BaseException) -> None:
        """The connection is gone: fail what waits and unmap both segments."""
        self._terms = None
        if self._current is not None:
            self._conn.mesh.mailbox.abandon(self._current[0], exc)
            self._current = None
        if self.out is not None:  # the outbox fails its queue on a ConnectionError
            lost = ConnectionResetError(f"connection to rank {self.peer} lost: {exc}")
            self.out.fail(lost)
            self.out.segment.close()
        if self._offered is not None:
            self._offered.unlink()
            self._offered.close()
            self._offered = None
        if self.inbox is not None:
            self.inbox.close()
        self._settle()
