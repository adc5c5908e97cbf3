"""Checksums of data frames: xxh3-64 over the meta bytes and the payload, in a trailer.

A data frame whose meta map has ``ck: 1`` carries, after its payload, 8 more bytes
(counted in the prefix's payload length): the xxh3-64 digest, big endian, of the frame's
meta bytes as sent followed by the payload. The sender hashes each slice of the payload
just before handing it to the kernel and the receiver each slice just after the kernel
wrote it, so the data is hashed while it is in cache and a flipped bit anywhere in the
meta or the payload is caught. xxh3 runs at memory speed, which is what keeps it on by
default. It detects corruption, not forgery: against an attacker on the path, use TLS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

from shardwire.protocol.errors import IntegrityError

if TYPE_CHECKING:
    from shardwire.protocol.tensors import TensorMeta

CHECK_KEY = "ck"
TRAILER_BYTES = 8
Digest = xxhash.xxh3_64


def meta_digest(meta_bytes: bytes | memoryview) -> Digest:
    """A running digest seeded with a frame's meta bytes; the payload is added to it."""
    return xxhash.xxh3_64(meta_bytes)


def integrity_error(meta: TensorMeta, *, rank: int, missing: bool) -> IntegrityError:
    """The error for a received frame whose checksum is ``missing`` or wrong."""
    where = (
        f"{meta.op} #{meta.tag.seq} (group {meta.tag.group}, step {meta.tag.step}) "
        f"from rank {meta.src} on rank {rank}"
    )
    if missing:
        text = f"{where} carries no checksum; set SHARDWIRE_CHECKSUM the same on every rank"
    else:
        text = f"integrity check failed for {where}: the data was corrupted between the ranks"
    return IntegrityError(text, peer=meta.src, op=meta.op, seq=meta.tag.seq)
