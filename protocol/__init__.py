"""Wire protocol: frames, codec, control messages, handshake, errors. Pure: no IO."""

from shardwire.protocol.auth import Token
from shardwire.protocol.control import frame_message, message_bytes
from shardwire.protocol.decoder import SMALL_STAGE, FrameDecoder, StagePool
from shardwire.protocol.errors import (
    AuthFailed,
    CollectiveCancelled,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    DescriptorLimit,
    FrameTooLarge,
    IntegrityError,
    JobAborted,
    MessageMismatch,
    PeerFailed,
    ProtocolError,
    RendezvousError,
    ShardwireError,
    TransportClosed,
    VersionMismatch,
)
from shardwire.protocol.frames import (
    HANDSHAKE_LIMITS,
    PROTOCOL_VERSION,
    Frame,
    FrameKind,
    Header,
    Limits,
    encode_head,
)
from shardwire.protocol.handshake import ClientHandshake, ServerHandshake
from shardwire.protocol.tensors import Tag, TensorMeta, check_dtype, parse_tensor_meta

__all__ = [
    "HANDSHAKE_LIMITS",
    "PROTOCOL_VERSION",
    "SMALL_STAGE",
    "AuthFailed",
    "ClientHandshake",
    "CollectiveCancelled",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DescriptorLimit",
    "IntegrityError",
    "Frame",
    "FrameDecoder",
    "FrameKind",
    "FrameTooLarge",
    "Header",
    "JobAborted",
    "Limits",
    "MessageMismatch",
    "PeerFailed",
    "ProtocolError",
    "RendezvousError",
    "ServerHandshake",
    "ShardwireError",
    "StagePool",
    "Tag",
    "TensorMeta",
    "Token",
    "TransportClosed",
    "VersionMismatch",
    "check_dtype",
    "encode_head",
    "frame_message",
    "message_bytes",
    "parse_tensor_meta",
]
