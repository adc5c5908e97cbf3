"""Control and handshake messages as frames."""

from __future__ import annotations

from shardwire.protocol.errors import ProtocolError
from shardwire.protocol.frames import Frame, FrameKind, encode_head
from shardwire.protocol.messages import (
    Challenge,
    Hello,
    Message,
    Proof,
    Welcome,
    decode_message,
    encode_message,
)

_HANDSHAKE_TYPES = (Hello, Challenge, Proof, Welcome)


def message_bytes(msg: Message) -> bytes:
    """Encode a message as one complete frame."""
    kind = FrameKind.HANDSHAKE if isinstance(msg, _HANDSHAKE_TYPES) else FrameKind.CONTROL
    return encode_head(kind, encode_message(msg))


def frame_message(frame: Frame) -> Message:
    """Validate a handshake or control frame into a message."""
    if frame.kind is FrameKind.DATA:
        raise ProtocolError("expected a control message, got a data frame")
    msg = decode_message(frame.meta)
    is_handshake = isinstance(msg, _HANDSHAKE_TYPES)
    if is_handshake != (frame.kind is FrameKind.HANDSHAKE):
        raise ProtocolError(f"message {msg.kind!r} arrived in a {frame.kind.name} frame")
    return msg
