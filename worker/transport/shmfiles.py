"""Named shared-memory files of a run: created exclusively, attached only after checks,
swept by name prefix.

Every file is ``shardwire-<hash of run id>-<32 random hex digits>`` in ``/dev/shm``: a
name that is unguessable and tied to the run, the prefix the node agent sweeps. It is
created exclusively, mode 0600, its pages reserved up front (``posix_fallocate``: a
full ``/dev/shm`` is an error at creation, never a SIGBUS later), and stamped with a
magic and a nonce. Another rank attaches only a regular file of this user, mode 0600,
of the expected size, holding the offered nonce. The pair segments of the shared-memory
links (``transport.shm``) and the node arena's regions (``arena.region``) are such files.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from shardwire.protocol import ProtocolError

SHM_DIR = Path("/dev/shm")
NONCE_BYTES = 16


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
