"""The node arena's shared-memory region: one file per node and group, O(k) bytes.

Layout (k local ranks, slot size S)::

    0       header page: magic, nonce, k, S; the abort word at ABORT
    4096    one 512-byte row per local rank (see ``board``): sequence words, bell,
            call signatures, and the cause when that rank poisoned the arena
    DATA    k slots of S bytes, each used as two halves (double buffering)

The region is created by one rank with a name that is unguessable and tied to the run
(``shardwire-<hash of run id>-<32 random hex digits>``, the prefix the node agent
sweeps), exclusively, mode 0600, its pages reserved up front (``posix_fallocate``: a
full ``/dev/shm`` is an error at creation, never a SIGBUS later). The others attach
only a regular file of this user, mode 0600, of the expected size, holding the offered
nonce; once every rank has attached, the creator unlinks the name, so nothing is left
behind by any exit, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from pathlib import Path

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.transport.shmfiles import (
    SHM_DIR,
    attach_mapped,
    create_mapped,
)

MAGIC = b"SWARENA1"
PAGE = 4096
ROW_BYTES = 512
ABORT = 64  # offset of the abort word (u32) in the header page
ALIGN = 64  # data offsets within a half are multiples of this


class Geometry:
    """Where everything lies in a region of ``ranks`` rows and slots of ``slot_bytes``."""

    def __init__(self, ranks: int, slot_bytes: int) -> None:
        if ranks < 1 or slot_bytes < 2 * PAGE:
            raise InvalidArgument(
                f"an arena needs ranks >= 1 and slots >= 8 KiB, got {ranks}, {slot_bytes}"
            )
        self.ranks = ranks
        self.slot_bytes = slot_bytes
        self.half_bytes = (slot_bytes // 2) // ALIGN * ALIGN
        rows_end = PAGE + ranks * ROW_BYTES
        self.data = -(-rows_end // PAGE) * PAGE
        self.size = self.data + ranks * slot_bytes

    def row(self, rank: int) -> int:
        return PAGE + rank * ROW_BYTES

    def half(self, rank: int, which: int) -> int:
        return self.data + rank * self.slot_bytes + which * self.half_bytes


class Region:
    """One mapped arena file."""

    def __init__(self, path: Path, mapping: mmap.mmap, geometry: Geometry) -> None:
        self.path = path
        self.geometry = geometry
        self.map: mmap.mmap | None = mapping
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(mapping)
        self.base = ctypes.addressof(self._anchor)

    @classmethod
    def create(
        cls, run_id: str, geometry: Geometry, directory: Path = SHM_DIR
    ) -> tuple[Region, bytes]:
        """A new region and its nonce; raises OSError if it cannot be made."""
        path, mapping, nonce = create_mapped(run_id, geometry.size, MAGIC, directory)
        return cls(path, mapping, geometry), nonce

    @classmethod
    def attach(
        cls, run_id: str, name: str, geometry: Geometry, nonce: bytes, directory: Path = SHM_DIR
    ) -> Region:
        """Map the region another rank created, after checking it is the one offered
        (OSError or ProtocolError if not)."""
        path, mapping = attach_mapped(
            run_id, name, geometry.size, magic=MAGIC, nonce=nonce, directory=directory
        )
        return cls(path, mapping, geometry)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        """Unmap (once no view of it is left; until then the mapping stays)."""
        if self.map is None:
            return
        self._anchor = None
        try:
            self.map.close()
        except BufferError:  # an array view is still alive: unmapped when it goes
            pass
        self.map = None
