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

MAGIC = b"SW"
PROTOCOL_VERSION = 1
PREFIX = struct.Struct(">2sBBIQ")
PREFIX_SIZE = PREFIX.size
MAX_META_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 1 << 32  # 4 GiB; configurable per connection


class FrameKind(enum.IntEnum):
    """What a frame carries."""

    CONTROL = 1  # a control message (pydantic model) in meta, no payload
    DATA = 2  # tensor meta plus raw array bytes
    HANDSHAKE = 3  # authentication exchange before anything else is accepted


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-connection limits, enforced from the prefix."""

    max_meta: int = MAX_META_BYTES
    max_payload: int = DEFAULT_MAX_PAYLOAD


@dataclass(frozen=True, slots=True)
class Frame:
    """A fully received frame. ``payload`` is the buffer the allocator supplied."""

    kind: FrameKind
    meta: dict[str, Any]
    payload: memoryview


@dataclass(frozen=True, slots=True)
class Header:
    """Kind, meta and payload size of a frame whose payload has not arrived yet."""

    kind: FrameKind
    meta: dict[str, Any]
    payload_len: int


def encode_head(kind: FrameKind, meta: dict[str, Any], payload_len: int = 0) -> bytes:
    """Return prefix and meta bytes; the payload is written separately, uncopied."""
    meta_bytes = pack_meta(meta)
    if len(meta_bytes) > MAX_META_BYTES:
        raise FrameTooLarge(f"meta map is {len(meta_bytes)} bytes, limit {MAX_META_BYTES}")
    prefix = PREFIX.pack(MAGIC, PROTOCOL_VERSION, int(kind), len(meta_bytes), payload_len)
    return prefix + meta_bytes


def parse_prefix(
    prefix: bytes | bytearray | memoryview, limits: Limits
) -> tuple[FrameKind, int, int]:
    """Validate a 16-byte prefix and return (kind, meta length, payload length)."""
    magic, version, kind, meta_len, payload_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(ours=PROTOCOL_VERSION, theirs=version)
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if meta_len > limits.max_meta:
        raise FrameTooLarge(f"meta length {meta_len} exceeds limit {limits.max_meta}")
    if payload_len > limits.max_payload:
        raise FrameTooLarge(f"payload length {payload_len} exceeds limit {limits.max_payload}")
    if frame_kind is not FrameKind.DATA and payload_len:
        raise ProtocolError(f"{frame_kind.name} frame carries {payload_len} payload bytes")
    return frame_kind, meta_len, payload_len


Allocator = Callable[[Header], memoryview]


def default_allocator(header: Header) -> memoryview:
    """Allocate a fresh bytearray for the payload (used when nobody waits for it)."""
    return memoryview(bytearray(header.payload_len))


class _State(enum.Enum):
    PREFIX = enum.auto()  # collecting the 16-byte prefix
    META = enum.auto()  # collecting the msgpack meta map
    PAYLOAD = enum.auto()  # filling the allocator's buffer
    BROKEN = enum.auto()  # a violation was seen; the connection must close


_EMPTY = memoryview(b"")


class FrameDecoder:
    """Incremental decoder, driven like ``asyncio.BufferedProtocol``.

    Call :meth:`get_buffer`, write up to ``len(buffer)`` bytes into it, then call
    :meth:`buffer_updated` with the count; it returns the frames completed. For byte
    strings use :meth:`feed`.
    """

    def __init__(self, *, limits: Limits | None = None, allocator: Allocator | None = None):
        self._limits = limits or Limits()
        self._allocate = allocator or default_allocator
        self._prefix = bytearray(PREFIX_SIZE)
        self._state = _State.PREFIX
        self._target = memoryview(self._prefix)
        self._filled = 0
        self._kind = FrameKind.CONTROL
        self._payload_len = 0
        self._meta: dict[str, Any] = {}
        self._meta_buf = bytearray()

    @property
    def mid_frame(self) -> bool:
        """True when some bytes of an unfinished frame have been received."""
        return self._state is not _State.PREFIX or self._filled > 0

    def get_buffer(self) -> memoryview:
        """Where the next received bytes must be written."""
        if self._state is _State.BROKEN:
            raise ProtocolError("decoder is broken after an earlier protocol violation")
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last :meth:`get_buffer` view."""
        self._filled += nbytes
        frames: list[Frame] = []
        try:
            while self._filled == len(self._target):
                frame = self._advance()
                if frame is not None:
                    frames.append(frame)
        except Exception:
            self._state = _State.BROKEN
            raise
        return frames

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Decode a byte string (copies it into the destinations)."""
        view = memoryview(data).cast("B")
        frames: list[Frame] = []
        while view:
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    def _advance(self) -> Frame | None:
        if self._state is _State.PREFIX:
            self._kind, meta_len, self._payload_len = parse_prefix(self._prefix, self._limits)
            self._meta_buf = bytearray(meta_len)
            return self._enter(_State.META, memoryview(self._meta_buf))
        if self._state is _State.META:
            self._meta = unpack_meta(self._meta_buf)
            header = Header(self._kind, self._meta, self._payload_len)
            target = self._allocate(header) if self._payload_len else _EMPTY
            if len(target) != self._payload_len:
                raise ProtocolError(
                    f"allocator returned {len(target)} bytes for a {self._payload_len}-byte payload"
                )
            return self._enter(_State.PAYLOAD, target)
        frame = Frame(self._kind, self._meta, self._target)
        self._enter(_State.PREFIX, memoryview(self._prefix))
        return frame

    def _enter(self, state: _State, target: memoryview) -> Frame | None:
        self._state = state
        self._target = target
        self._filled = 0
        if state is not _State.PREFIX and len(target) == 0:
            return self._advance()
        return None
