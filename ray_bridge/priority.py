"""The CPU priority a rank runs at on Ray.

Ray starts its worker processes at a niceness of its own (``RAY_worker_niceness``, 15), so
that its own daemons stay responsive. A rank of a training job is the job's work: at 15,
beside any process at the usual niceness 0 its share of a core is a few percent, its
steps take many times as long and its heartbeats can be late enough for the coordinator
to take it for hung. A rank therefore runs at the niceness it is given (the driver's own,
so ``nice -n 10 shardwire ray ...`` still runs the job gently), where the host lets the
process lower its niceness (root, or ``CAP_SYS_NICE``, or ``RLIMIT_NICE``); where it may
not, it says so once and runs on at Ray's.

Linux keeps a niceness per thread: every thread of the process is set, Ray's threads
included (they carry the rank's calls), and threads started later inherit it.
"""

from __future__ import annotations

import os
from pathlib import Path


def threads() -> list[int]:
    """The ids of this process's threads."""
    try:
        return [int(entry.name) for entry in Path("/proc/self/task").iterdir()]
    except OSError:  # no /proc: the calling thread is all that can be named
        return [0]


def run_at(niceness: int, rank: int) -> str | None:
    """Set every thread of this process to ``niceness``; None, or what keeps it from it."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    if now == niceness:
        return None
    try:
        for tid in threads():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except PermissionError:
        return (
            f"rank {rank} runs at niceness {now} (Ray's worker niceness), not the driver's "
            f"{niceness}: this host does not let it lower its niceness, and beside other "
            f"work its steps slow down and its heartbeats may come late; start the Ray "
            f"nodes with RAY_worker_niceness={niceness} in their environment"
        )
    return None
