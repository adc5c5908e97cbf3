"""Busy polling: a waiting receive keeps the event loop polling for a while instead of
letting it sleep.

A rank that waits for a message sleeps in ``epoll_wait``, and waking it when the bytes
arrive costs the kernel's wake-up latency on every message: measured on this 2-core
machine with 2 ranks, 4 KiB all_reduce, 100 us per call sleeping against 76 us polling
for up to 100 us. While a receive waits, :class:`BusyPoll` keeps one callback scheduled
on the loop, so the loop polls its sockets without blocking and runs every other task as
usual; it stops when the awaited message arrived or after ``budget`` seconds, and the
loop sleeps again.

Only receives of small messages poll (``POLL_MAX_BYTES``). It pays for sure only when
each rank has a core of its own. With more ranks than cores
on a node a polling rank takes the core another rank needs (2 cores, 4 ranks: 622 us
polling against 505 us sleeping), so the default budget is zero there
(:func:`default_budget`); a budget set explicitly then polls with ``sched_yield`` on
every turn, which hands the core to a rank that has work (measured 360 against 505 us,
though 3 ranks measured 10 % slower and other collectives went either way: the
scheduler decides).
"""

from __future__ import annotations

import asyncio
import os
import time

# How long a waiting receive polls by default when each rank has a core of its own.
DEFAULT_POLL_US = 100
# Only receives of at most this many bytes poll: a larger message takes long enough to
# move that the wake-up is a small share of it, while polling through it takes CPU from
# compute (polling every receive, an FSDP step at 2 ranks on 2 cores, whose gathers are
# MiBs, measured 3-8 % slower in two runs; polling small ones only, three runs were
# within noise of no polling).
POLL_MAX_BYTES = 64 * 1024


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_budget(local_ranks: int, cpus: int, setting_us: int | None) -> float:
    """Seconds a receive polls: ``setting_us`` if given, else DEFAULT_POLL_US when the
    ``local_ranks`` ranks of this node have at least as many ``cpus``, else zero."""
    if setting_us is not None:
        return setting_us * 1e-6
    return DEFAULT_POLL_US * 1e-6 if local_ranks <= cpus else 0.0


class BusyPoll:
    """Keeps one loop callback going while a receive waits (see the module docstring)."""

    def __init__(self, budget: float = 0.0, *, yield_cpu: bool = False) -> None:
        self.budget = budget
        self.yield_cpu = yield_cpu  # give up the CPU on every turn (more ranks than cores)
        self.polls = 0  # loop turns spent polling, for tests and stats
        self._future: asyncio.Future | None = None
        self._until = 0.0
        self._active = False

    def hold(self, future: asyncio.Future) -> None:
        """Poll until ``future`` is done, at most ``budget`` seconds from now."""
        if self.budget <= 0:
            return
        self._future = future
        self._until = time.perf_counter() + self.budget
        if not self._active:
            self._active = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        future = self._future
        if future is None or future.done() or time.perf_counter() >= self._until:
            self._active = False
            self._future = None
            return
        self.polls += 1
        if self.yield_cpu:
            os.sched_yield()
        asyncio.get_running_loop().call_soon(self._tick)
