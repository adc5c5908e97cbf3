"""The incremental frame decoder (the format is in :mod:`shardwire.protocol.frames`).

A pure state machine with the shape of ``asyncio.BufferedProtocol``: :meth:`get_buffer`
says where the next bytes must go and :meth:`buffer_updated` reports how many arrived.
Limits are checked from the prefix before a single meta or payload byte is buffered.
When a meta map is complete the decoder asks an *allocator* for the payload's
destination, so a receive can land directly in the caller's numpy array.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from shardwire.protocol.codec import unpack_meta
from shardwire.protocol.errors import ProtocolError
from shardwire.protocol.frames import (
    PREFIX_SIZE,
    Frame,
    FrameKind,
    Header,
    Limits,
    parse_prefix,
)
from shardwire.protocol.integrity import CHECK_KEY, TRAILER_BYTES, Digest, meta_digest

# Returns the payload's destination, or None to decide later (see FrameDecoder.resume).
Allocator = Callable[[Header], memoryview | None]


def default_allocator(header: Header) -> memoryview:
    """Allocate a fresh bytearray for the payload (used when nobody waits for it)."""
    return memoryview(bytearray(header.payload_len))


class _State(enum.Enum):
    STAGED = enum.auto()  # bytes land in the staging buffer; headers are parsed from there
    DIRECT = enum.auto()  # the rest of a large payload lands straight in its destination
    BROKEN = enum.auto()  # a violation was seen; the connection must close


_EMPTY = memoryview(b"")

# Small frames are read many at a time into a staging buffer (one recv call for a burst
# of 4 KiB messages instead of three per frame); once the remainder of a payload is at
# least DIRECT_MIN bytes, the kernel writes it straight into the destination array.
STAGE_BYTES = 256 * 1024
DIRECT_MIN = 64 * 1024
# At most this much is read into the stage at once: enough for a burst of small frames
# per syscall, little enough that a large payload is mostly read straight into place.
STAGE_READ = 64 * 1024
# An unauthenticated connection starts with this small stage; it grows only as far as a
# frame within the connection's limits needs.
SMALL_STAGE = 4 * 1024


class StagePool:
    """Staging buffers shared by the decoders of one process's peer connections. A
    decoder borrows one for each burst it reads and gives it back once it has parsed
    every byte, so idle connections hold only their small stage: memory grows with the
    connections receiving at the same moment, not with the number of peers."""

    def __init__(self, size: int = STAGE_BYTES, keep: int = 8) -> None:
        self.size = size
        self._keep = keep
        self._idle: list[bytearray] = []
        self.lent = 0  # buffers out now (for tests and stats)

    def take(self) -> bytearray:
        self.lent += 1
        return self._idle.pop() if self._idle else bytearray(self.size)

    def give(self, stage: bytearray) -> None:
        self.lent -= 1
        if len(stage) == self.size and len(self._idle) < self._keep:
            self._idle.append(stage)


class FrameDecoder:
    """Incremental decoder, driven like ``asyncio.BufferedProtocol``.

    Call :meth:`get_buffer`, write up to ``len(buffer)`` bytes into it, call
    :meth:`buffer_updated` with the count, then take frames with :meth:`next_frame` until
    it returns None. Frames are parsed one at a time, so whatever the caller does with a
    frame (finishing a handshake, say) happens before the next header is looked at. For
    byte strings use :meth:`feed`. The staging buffer starts at ``stage_bytes`` and grows
    only as far as a frame within the limits needs; a prefix announcing any size
    allocates nothing before its limits are checked. :meth:`upgrade` raises the limits
    (and the stage) once the peer is authenticated.
    """

    def __init__(
        self,
        *,
        limits: Limits | None = None,
        allocator: Allocator | None = None,
        stage_bytes: int = STAGE_BYTES,
    ):
        self._limits = limits or Limits()
        self._allocate = allocator or default_allocator
        self._stage = bytearray(stage_bytes)
        self._view = memoryview(self._stage)
        self._read = min(STAGE_READ, stage_bytes // 2)
        self._start = 0  # first unparsed staged byte
        self._end = 0  # end of staged bytes
        self._state = _State.STAGED
        self._prefix: tuple[FrameKind, int, int] | None = None
        self._header: Header | None = None
        self._target = _EMPTY
        self._filled = 0
        self._waiting = False  # a header's destination is still to be decided
        self._digest: Digest | None = None  # running checksum of the current frame
        self._pool: StagePool | None = None  # big stages are borrowed from here
        self._resident: bytearray | None = None  # the small stage, while one is borrowed

    @property
    def stage_bytes(self) -> int:
        """Size of the staging buffer now."""
        return len(self._stage)

    def upgrade(
        self, limits: Limits, *, stage_bytes: int = STAGE_BYTES, pool: StagePool | None = None
    ) -> None:
        """Apply the limits of an authenticated connection, with a stage of at least
        ``stage_bytes``, or (``pool``) a stage borrowed from the pool for every burst;
        frames already parsed are unaffected."""
        self._limits = limits
        if pool is not None:
            self._pool = pool
            self._read = min(STAGE_READ, pool.size // 2)
            return
        if stage_bytes > len(self._stage):
            self._resize(stage_bytes)
        self._read = min(STAGE_READ, len(self._stage) // 2)

    @property
    def borrowing(self) -> bool:
        """True while a stage borrowed from the pool holds unparsed bytes."""
        return self._resident is not None

    def _borrow(self) -> None:
        assert self._pool is not None
        stage = self._pool.take()
        avail = self._end - self._start
        stage[:avail] = self._view[self._start : self._end]
        self._resident = self._stage
        self._stage, self._view = stage, memoryview(stage)
        self._start, self._end = 0, avail

    def _give_back(self) -> None:
        assert self._pool is not None and self._resident is not None
        self._pool.give(self._stage)
        self._stage, self._resident = self._resident, None
        self._view = memoryview(self._stage)

    @property
    def mid_frame(self) -> bool:
        """True when some bytes of an unfinished frame have been received."""
        return self._prefix is not None or self._end > self._start

    @property
    def waiting(self) -> bool:
        """True while the allocator deferred a destination and :meth:`resume` is due."""
        return self._waiting

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written."""
        if self._state is _State.DIRECT:
            return self._target[self._filled :]
        if self._state is _State.BROKEN:
            raise ProtocolError("decoder is broken after an earlier protocol violation")
        if self._pool is not None and self._resident is None:
            self._borrow()
        if self._end + self._read > len(self._stage):
            self._compact()
            if self._end + self._read > len(self._stage):  # a frame's meta is still partial
                self._resize(self._end + self._read)
        return self._view[self._end : self._end + self._read]

    def buffer_updated(self, nbytes: int) -> None:
        """Account for ``nbytes`` written into the last :meth:`get_buffer` view."""
        if self._state is _State.DIRECT:
            if self._digest is not None:  # hashed while the kernel's copy is in cache
                self._digest.update(self._target[self._filled : self._filled + nbytes])
            self._filled += nbytes
            if self._filled == len(self._target):
                self._state = _State.STAGED
        else:
            self._end += nbytes

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None until more bytes (or :meth:`resume`) arrive."""
        if self._state is _State.BROKEN:
            raise ProtocolError("decoder is broken after an earlier protocol violation")
        try:
            return self._parse_one()
        except Exception:
            self._state = _State.BROKEN
            raise

    def resume(self, target: memoryview) -> None:
        """Supply the destination the allocator deferred."""
        assert self._waiting and self._header is not None
        try:
            self._check_target(target, self._header.payload_len)
        except Exception:
            self._state = _State.BROKEN
            raise
        self._waiting = False
        self._target = target

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Decode a byte string (copies it into the destinations)."""
        view = memoryview(data).cast("B")
        frames: list[Frame] = []
        while view:
            view = self.fill(view)
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
        return frames

    def fill(self, view: memoryview) -> memoryview:
        """Copy as much of ``view`` as the next buffer takes; returns the rest."""
        buf = self.get_buffer()
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        self.buffer_updated(n)
        return view[n:]

    def _parse_one(self) -> Frame | None:
        while not self._waiting and self._state is _State.STAGED:
            header = self._header
            avail = self._end - self._start
            if header is not None and self._filled == header.payload_len:
                if self._digest is None:
                    return self._finish(None)
                if avail < TRAILER_BYTES:
                    break
                trailer = self._view[self._start : self._start + TRAILER_BYTES]
                self._start += TRAILER_BYTES
                return self._finish(self._digest.digest() == trailer)
            if self._prefix is None:
                if avail < PREFIX_SIZE:
                    break
                self._prefix = parse_prefix(
                    self._view[self._start : self._start + PREFIX_SIZE], self._limits
                )
                self._start += PREFIX_SIZE
            elif header is None:
                kind, meta_len, payload_len = self._prefix
                if avail < meta_len:
                    if self._start + meta_len > len(self._stage):
                        self._compact()
                    break
                raw = self._view[self._start : self._start + meta_len]
                meta = unpack_meta(raw)
                if kind is FrameKind.DATA and meta.get(CHECK_KEY) == 1:
                    if payload_len < TRAILER_BYTES:
                        raise ProtocolError("checksummed data frame shorter than its trailer")
                    self._digest = meta_digest(raw)
                    payload_len -= TRAILER_BYTES
                self._start += meta_len
                self._begin_payload(Header(kind, meta, payload_len))
            else:
                need = header.payload_len - self._filled
                take = min(avail, need)
                if take:
                    chunk = self._view[self._start : self._start + take]
                    self._target[self._filled : self._filled + take] = chunk
                    if self._digest is not None:
                        self._digest.update(chunk)
                self._start += take
                self._filled += take
                if take < need:
                    self._start = self._end = 0
                    if need - take >= DIRECT_MIN:
                        self._state = _State.DIRECT
                    break
        if self._start == self._end:
            self._start = self._end = 0
            if self._resident is not None:  # every byte parsed: the stage goes back
                self._give_back()
        return None

    def _begin_payload(self, header: Header) -> None:
        target = self._allocate(header) if header.payload_len else _EMPTY
        self._header = header
        self._filled = 0
        if target is None:
            self._waiting = True
            return
        self._check_target(target, header.payload_len)
        self._target = target

    @staticmethod
    def _check_target(target: memoryview, payload_len: int) -> None:
        if len(target) != payload_len:
            raise ProtocolError(
                f"allocator returned {len(target)} bytes for a {payload_len}-byte payload"
            )

    def _finish(self, intact: bool | None) -> Frame:
        assert self._header is not None
        frame = Frame(self._header.kind, self._header.meta, self._target, intact)
        self._digest = None
        self._prefix = None
        self._header = None
        self._target = _EMPTY
        self._filled = 0
        return frame

    def _resize(self, size: int) -> None:
        """Move the unparsed bytes into a fresh stage of ``size`` bytes."""
        self._compact()
        stage = bytearray(size)
        stage[: self._end] = self._view[: self._end]
        self._stage, self._view = stage, memoryview(stage)

    def _compact(self) -> None:
        """Move unparsed bytes to the front of the staging buffer."""
        avail = self._end - self._start
        self._stage[:avail] = self._stage[self._start : self._end]
        self._start, self._end = 0, avail
