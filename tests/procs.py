"""The processes a test started, found through /proc: by parentage, never by name (a
test process beside this one may run the same script)."""

from __future__ import annotations

from pathlib import Path

from shardwire.worker.kernels.procstat import stat_fields


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody reaped yet has ended)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None:
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found
