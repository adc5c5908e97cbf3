"""Frame format: encoding, and the prefix checks the decoder (``protocol.decoder``) makes.

Theory of operation
-------------------
Every frame is a 16-byte prefix, a msgpack *meta* map and raw *payload* bytes::

    offset size  field
    0      2     magic  b"SW"
    2      1     protocol version
    3      1     kind   (control | data | handshake)
    4      4     meta length    (u32, big endian)
    8      8     payload length (u64, big endian)

Senders write ``[prefix + meta, memoryview(array)]`` without joining them. Limits are
checked from the prefix before a single meta or payload byte is buffered.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from shardwire.protocol.codec import pack_meta
from shardwire.protocol.errors import FrameTooLarge, ProtocolError, VersionMismatch
from shardwire.protocol.integrity import CHECK_KEY, TRAILER_BYTES, Digest, meta_digest
from shardwire.protocol.tensors import TensorMeta, pack_tensor_meta

MAGIC = b"SW"
PROTOCOL_VERSION = 4
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
