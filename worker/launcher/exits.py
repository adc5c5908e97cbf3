"""How a rank's process ended, told right even before asyncio has reaped it.

asyncio learns that a child ended from its child watcher: a thread that reaps it and
then hands the status to the event loop (Python 3.11), or the loop itself once it reads
the child's pidfd (3.12 and later). Until the loop has run that, ``Process.returncode``
is None though the process is dead: a zombie, or already reaped. The coordinator
declares a killed rank failed as soon as its connection closes, which can be inside
that window, so the node agent asks the kernel before it calls the process hung:
``waitid`` with ``WNOWAIT`` reads the exit status and leaves the child for the watcher
to reap, and ``ECHILD`` says the watcher reaped it already.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from shardwire.worker.kernels.procstat import stat_fields


def ended_how(code: int) -> str:
    """A returncode as asyncio gives it (negative: the signal) in words."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class Exited:
    """A child process that ended."""

    code: int | None  # its returncode (negative: the signal); None: reaped, not yet told

    def __str__(self) -> str:
        return "ended" if self.code is None else ended_how(self.code)


def exited(pid: int) -> Exited | None:
    """How this process's child ``pid`` ended, without reaping it; None while it runs
    (a stopped process runs, as far as this goes)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # the watcher reaped it; the loop has not run its callback
        return Exited(None)
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return Exited(info.si_status)
    return Exited(-info.si_status)  # CLD_KILLED, CLD_DUMPED: the signal


def failed_rank(rank: int, ended: Exited | None) -> tuple[str, bool]:
    """What the node agent says of ``rank``, which the coordinator declared failed while
    its process seemed to run, and whether it must kill that process to start it anew:
    only one that still runs (``ended`` None), as a hung process does. A process that
    ended is replaced as soon as it is reaped."""
    if ended is None:
        return (
            f"rank {rank} failed while its process runs (hung?): killing it (SIGKILL) to "
            "start it anew",
            True,
        )
    if ended.code is None:
        return f"rank {rank} failed: its process had already ended", False
    return f"rank {rank} failed: its process had already ended ({ended})", False


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc ("T" stopped, "Z" a zombie), "" once it is
    gone or where there is no /proc."""
    fields = stat_fields(pid)
    return "" if fields is None else fields[0]
