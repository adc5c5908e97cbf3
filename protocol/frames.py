"""Frame format and the incremental frame decoder.

Theory of operation
-------------------
Every frame is a 16-byte prefix, a msgpack *meta* map and raw *payload* bytes::

    offset size  field
    0      2     magic  b"SW"
    2      1     protocol version
    3      1     kind   (control | data | handshake)
    4      4     meta length    (u32, big endian)
    8      8     payload length (u64, big endian)

Senders write ``[prefix + meta, memoryview(array)]`` without joining them. The decoder is
a pure state machine with the shape of ``asyncio.BufferedProtocol``: :meth:`get_buffer`
says where the next bytes must go and :meth:`buffer_updated` reports how many arrived.
Limits are checked from the prefix before a single meta or payload byte is buffered.
When a meta map is complete the decoder asks an *allocator* for the payload's
destination, so a receive can land directly in the caller's numpy array.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardwire.protocol.codec import pack_meta, unpack_meta
from shardwire.protocol.errors import FrameTooLarge, ProtocolError, VersionMismatch
from shardwire.protocol.integrity import CHECK_KEY, TRAILER_BYTES, Digest, meta_digest
from shardwire.protocol.tensors import TensorMeta, pack_tensor_meta

MAGIC = b"SW"
PROTOCOL_VERSION = 2
PREFIX = struct.Struct(">2sBBIQ")
PREFIX_SIZE = PREFIX.size
MAX_META_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 1 << 32  # 4 GiB; configurable per connection


class FrameKind(enum.IntEnum):
    """What a frame carries."""

    CONTROL = 1  # a control message (pydantic model) in meta, no payload
    DATA = 2  # tensor meta plus raw array bytes
    HANDSHAKE = 3  # authentication exchange before anything else is accepted


_KINDS = {int(k): k for k in FrameKind}


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-connection limits, enforced from the prefix."""

    max_meta: int = MAX_META_BYTES
    max_payload: int = DEFAULT_MAX_PAYLOAD


# Before a connection is authenticated it may only exchange small handshake frames.
HANDSHAKE_LIMITS = Limits(max_meta=16 * 1024, max_payload=0)


@dataclass(frozen=True, slots=True)
class Frame:
    """A fully received frame. ``payload`` is the buffer the allocator supplied.

    ``intact`` is None for a frame without a checksum, else whether its checksum matched.
    """

    kind: FrameKind
    meta: dict[str, Any]
    payload: memoryview
    intact: bool | None = None


@dataclass(frozen=True, slots=True)
class Header:
    """Kind, meta and payload size of a frame whose payload has not arrived yet
    (``payload_len`` excludes a checksum trailer)."""

    kind: FrameKind
    meta: dict[str, Any]
    payload_len: int


def encode_head(kind: FrameKind, meta: dict[str, Any], payload_len: int = 0) -> bytes:
    """Return prefix and meta bytes; the payload is written separately, uncopied."""
    return _head(kind, pack_meta(meta), payload_len)


def _head(kind: FrameKind, meta_bytes: bytes, payload_len: int) -> bytes:
    if len(meta_bytes) > MAX_META_BYTES:
        raise FrameTooLarge(f"meta map is {len(meta_bytes)} bytes, limit {MAX_META_BYTES}")
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, kind, len(meta_bytes), payload_len)
    return prefix + meta_bytes


_SEALED = ((CHECK_KEY, 1),)


def encode_data_head(
    meta: TensorMeta, payload_len: int, extra: tuple[tuple[str, int], ...] = ()
) -> bytes:
    """Prefix and meta of a data frame for ``meta`` (plus ``extra`` meta fields)."""
    return _head(FrameKind.DATA, pack_tensor_meta(meta, extra), payload_len)


def encode_sealed_head(meta: TensorMeta, payload_len: int) -> tuple[bytes, Digest]:
    """Prefix and meta of a checksummed data frame, and the digest its payload is fed to;
    the frame ends with ``digest.digest()`` (see :mod:`shardwire.protocol.integrity`)."""
    meta_bytes = pack_tensor_meta(meta, _SEALED)
    head = _head(FrameKind.DATA, meta_bytes, payload_len + TRAILER_BYTES)
    return head, meta_digest(meta_bytes)


def parse_prefix(
    prefix: bytes | bytearray | memoryview, limits: Limits
) -> tuple[FrameKind, int, int]:
    """Validate a 16-byte prefix and return (kind, meta length, payload length)."""
    magic, version, kind, meta_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(ours=PROTOCOL_VERSION, theirs=version)
    frame_kind = _KINDS.get(kind)
    if frame_kind is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if meta_len > limits.max_meta:
        raise FrameTooLarge(f"meta length {meta_len} exceeds limit {limits.max_meta}")
    if payload_len > limits.max_payload:
        raise FrameTooLarge(f"payload length {payload_len} exceeds limit {limits.max_payload}")
    if frame_kind is not FrameKind.DATA and payload_len:
        raise ProtocolError(f"{frame_kind.name} frame carries {payload_len} payload bytes")
    return frame_kind, meta_len, payload_len


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

    @property
    def stage_bytes(self) -> int:
        """Size of the staging buffer now."""
        return len(self._stage)

    def upgrade(self, limits: Limits, *, stage_bytes: int = STAGE_BYTES) -> None:
        """Apply the limits of an authenticated connection, with a stage of at least
        ``stage_bytes``; frames already parsed are unaffected."""
        self._limits = limits
        if stage_bytes > len(self._stage):
            self._resize(stage_bytes)
        self._read = min(STAGE_READ, len(self._stage) // 2)

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
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
        return frames

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
