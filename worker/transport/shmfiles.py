"""Named shared-memory files of a run: created exclusively, attached only after checks,
swept by name prefix and owner.

Every file is ``shardwire-<hash of run id>-<owner>-<32 random hex digits>`` in
``/dev/shm``: a name that is unguessable, tied to the run and to the process that made it
(``<owner>`` is its pid and its start time, so a reused pid is not taken for it). A sweep
removes the run's names whose owner is gone (or is the sweeping process): the names a
killed rank left, never those of a live process, even of another job of the same run id
on this machine, which may be about to attach them. A file is created exclusively, mode
0600, its pages reserved up front (``posix_fallocate``: a full ``/dev/shm`` is an error
at creation, never a SIGBUS later), and stamped with a magic and a nonce. Another rank
attaches only a regular file of this user, mode 0600, of the expected size, holding the
offered nonce. The pair segments of the shared-memory links (``transport.shm``) and the
node arena's regions (``arena.region``) are such files.
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
from shardwire.worker.kernels.procstat import stat_fields

SHM_DIR = Path("/dev/shm")
NONCE_BYTES = 16


def run_prefix(run_id: str) -> str:
    """The name prefix of every shared-memory file of a run."""
    return "shardwire-" + hashlib.sha256(run_id.encode()).hexdigest()[:12]


def owner_tag(pid: int | None = None) -> str | None:
    """``<pid>-<start time>`` of process ``pid`` (this one by default); None if it is gone
    (a zombie too: it will remove nothing). The start time is the kernel's, in clock ticks
    since boot (``/proc/PID/stat``)."""
    pid = os.getpid() if pid is None else pid
    fields = stat_fields(pid)  # the start time is the file's field 22
    return None if fields is None or fields[0] in ("Z", "X") else f"{pid}-{fields[19]}"


def _own_tag() -> str:
    tag = owner_tag()
    assert tag is not None  # this process's own stat file is always there
    return tag


def _named(name: str, run_id: str) -> re.Match[str] | None:
    """``name`` parsed as a file name of ``run_id`` (its owner's pid and start time as
    groups 1 and 2); None if it is not one."""
    return re.fullmatch(re.escape(run_prefix(run_id)) + r"-(\d+)-(\d+)-[0-9a-f]{32}", name)


def _owner_gone(name: str, run_id: str) -> bool:
    """Whether the process that made file ``name`` no longer runs (or is this one). A
    name without an owner is another version's: gone."""
    found = _named(name, run_id)
    if found is None:
        return True
    pid = int(found.group(1))
    return pid == os.getpid() or owner_tag(pid) != f"{pid}-{found.group(2)}"


def segment_names(run_id: str, directory: Path = SHM_DIR) -> list[Path]:
    """Files of ``run_id`` that still have a name in ``directory``."""
    prefix = run_prefix(run_id) + "-"
    try:
        return sorted(p for p in directory.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def left_behind(run_id: str, directory: Path = SHM_DIR) -> list[Path]:
    """Files of ``run_id`` that still have a name and whose owner is gone or is this
    process: what a sweep removes (a live process's names are its own to remove)."""
    return [p for p in segment_names(run_id, directory) if _owner_gone(p.name, run_id)]


def sweep(run_id: str, directory: Path = SHM_DIR) -> int:
    """Remove :func:`left_behind` (by a rank leaving the job, an agent after its
    workers); returns how many there were."""
    removed = 0
    for path in left_behind(run_id, directory):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


def new_name(run_id: str) -> str:
    """A fresh file name of ``run_id`` owned by this process."""
    return f"{run_prefix(run_id)}-{_own_tag()}-{secrets.token_hex(16)}"


def create_mapped(
    run_id: str, size: int, magic: bytes, directory: Path = SHM_DIR
) -> tuple[Path, mmap.mmap, bytes]:
    """A new file of the run, exclusive, mode 0600, ``size`` bytes reserved, mapped and
    stamped with ``magic`` and a fresh nonce; raises OSError if it cannot be made."""
    path = directory / new_name(run_id)
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
    if _named(name, run_id) is None:
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
