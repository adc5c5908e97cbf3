"""msgpack for meta maps, unpacked with explicit size limits and no extension types."""

from __future__ import annotations

from typing import Any

import msgpack

from shardwire.protocol.errors import InvalidType, ProtocolError

# Meta maps are small (routing fields, dtype, shape); these bounds stop a hostile peer from
# making the unpacker allocate large containers from a tiny message.
_MAX_STR = 16 * 1024
_MAX_ARRAY = 4096
_MAX_MAP = 256


_PACKER = msgpack.Packer(use_bin_type=True, autoreset=True)


def pack_meta(meta: dict[str, Any]) -> bytes:
    """Pack a meta map (string keys, plain msgpack types only)."""
    return _PACKER.pack(meta)


def pack_value(value: Any) -> bytes:
    """Pack one plain value (a key, an int, a list of ints) of a meta map."""
    return _PACKER.pack(value)


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def unpack_meta(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Unpack a meta map, rejecting ext types, non-string keys and oversized containers."""
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=_MAX_STR,
            max_bin_len=len(data),
            max_array_len=_MAX_ARRAY,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"undecodable meta map: {exc}") from exc
    if not isinstance(value, dict):
        raise ProtocolError(f"meta must be a map, got {type(value).__name__}")
    return value


def pack_object(value: Any) -> bytes:
    """Pack a small user value for the object collectives."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError) as exc:
        raise InvalidType(f"value is not msgpack-serialisable: {exc}") from exc


def unpack_object(data: bytes | bytearray | memoryview) -> Any:
    """Unpack a value produced by :func:`pack_object` (no ext types)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"undecodable object payload: {exc}") from exc
