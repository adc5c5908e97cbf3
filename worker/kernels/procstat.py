"""A process as the kernel shows it in ``/proc/PID/stat``."""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command (which is in parentheses and
    may hold spaces): the state letter first (the file's field 3), so the file's field N
    is index N - 3. None once the process is gone, or where there is no /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    _command, _, rest = text.rpartition(")")
    return rest.split() or None
