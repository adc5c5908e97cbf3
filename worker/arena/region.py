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
import hashlib
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from shardwire.protocol import ProtocolError
from shardwire.protocol.errors import InvalidArgument

SHM_DIR = Path("/dev/shm")
MAGIC = b"SWARENA1"
NONCE_BYTES = 16
PAGE = 4096
ROW_BYTES = 512
ABORT = 64  # offset of the abort word (u32) in the header page
ALIGN = 64  # data offsets within a half are multiples of this


def run_prefix(run_id: str) -> str:
    """The name prefix of every shared-memory file of a run."""
    return "shardwire-" + hashlib.sha256(run_id.encode()).hexdigest()[:12]


def segment_names(run_id: str, directory: Path = SHM_DIR) -> list[Path]:
    """Files of ``run_id`` that still have a name in ``directory``."""
    prefix = run_prefix(run_id) + "-"
    try:
        return sorted(p for p in directory.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def sweep(run_id: str, directory: Path = SHM_DIR) -> int:
    """Remove the named files of ``run_id`` (after its workers are gone); returns how
    many there were."""
    removed = 0
    for path in segment_names(run_id, directory):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def create_mapped(
    run_id: str, size: int, magic: bytes, directory: Path = SHM_DIR
) -> tuple[Path, mmap.mmap, bytes]:
    """A new file of the run, exclusive, mode 0600, ``size`` bytes reserved, mapped and
    stamped with ``magic`` and a fresh nonce; raises OSError if it cannot be made."""
    path = directory / f"{run_prefix(run_id)}-{secrets.token_hex(16)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    finally:
        os.close(fd)
    nonce = secrets.token_bytes(NONCE_BYTES)
    mapping[: len(magic) + NONCE_BYTES] = magic + nonce
    return path, mapping, nonce


def attach_mapped(
    run_id: str, name: str, size: int, *, magic: bytes, nonce: bytes, directory: Path = SHM_DIR
) -> tuple[Path, mmap.mmap]:
    """Map another rank's file after checking it is the one offered: a name of the run,
    a regular file of this user, mode 0600, ``size`` bytes, ``magic`` and ``nonce``
    (OSError or ProtocolError if not)."""
    if not re.fullmatch(re.escape(run_prefix(run_id)) + r"-[0-9a-f]{32}", name):
        raise ProtocolError(f"shared-memory name {name!r} is not one of this run")
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ProtocolError(f"{path} is not a regular file of this user")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ProtocolError(f"{path} is readable by others")
        if info.st_size != size:
            raise ProtocolError(f"{path} holds {info.st_size} bytes, {size} offered")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mapping[: len(magic) + NONCE_BYTES] != magic + nonce:
        mapping.close()
        raise ProtocolError(f"{path} is not the one offered (nonce differs)")
    return path, mapping


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
