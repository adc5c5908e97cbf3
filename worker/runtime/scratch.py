"""Scratch directories a process owns while it lives, and the sweep of those whose owner
died without removing them.

The process that makes one holds an exclusive ``flock`` on the directory's ``owner`` file
for as long as it runs; the kernel drops the lock when the process ends, however it ends
(SIGKILL and the OOM killer included). Making a directory of a kind first removes the
directories of that kind, in the same parent, whose ``owner`` lock can be taken: their
owners are gone and nobody else would remove them. The file appears already locked (it is
locked under another name, then renamed), so a sweep never takes a live directory's lock;
a directory without it (being made this instant, or made by something else) is left alone,
as is one this user cannot open.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

OWNER = "owner"


class Scratch:
    """A new directory ``<parent>/<prefix>XXXXXXXX`` of mode 0700, owned by this process
    until :meth:`remove` (or its end); the dead owners' of the same prefix swept first."""

    def __init__(self, prefix: str, parent: str | None = None) -> None:
        self.swept = sweep(prefix, parent)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        claiming = self.path / f".{OWNER}-{os.getpid()}"
        self._fd: int | None = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(claiming, self.path / OWNER)

    def remove(self) -> None:
        """Remove the directory and let go of it (safe to call twice)."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep(prefix: str, parent: str | None = None) -> list[Path]:
    """Remove the directories ``<parent>/<prefix>*`` whose owner has ended; returns them."""
    root = Path(parent or tempfile.gettempdir())
    removed = []
    for entry in root.glob(f"{prefix}*"):
        try:
            fd = os.open(entry / OWNER, os.O_RDWR)
        except OSError:  # not a scratch directory, not ours, or being made
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its owner lives
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return removed
