"""Deadlines of a group's running calls, watched by one timer.

Every collective call is bounded by its group's timeout. ``asyncio.timeout`` per call
costs a timer created and cancelled each time (measured ~5.7 us a call here with uvloop,
about a tenth of a 4 KiB all_reduce), although a deadline almost never fires. Here a
call only notes its deadline and its task; one timer per group is armed at the earliest
deadline that can still fire. When it fires it cancels the tasks of the calls that are
past their deadline and re-arms itself for the next one, so a call that ends in time
costs a dict entry (~0.6 us).

A call's task cancelled this way gets ``CancelledError`` at the await it is suspended
in; :meth:`Deadlines.release` tells the call it expired (and takes that cancellation
back, as ``asyncio.timeout`` does), so the caller turns it into a timeout error.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

# libuv timers have millisecond resolution: a timer may fire this much before its time.
_SLACK = 1e-3


class Deadlines:
    """Deadlines of running calls, keyed by call sequence number."""

    def __init__(self) -> None:
        self._running: dict[int, tuple[float, asyncio.Task, int]] = {}
        self._on_expire: dict[int, Callable[[], None]] = {}
        self._expired: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf

    def watch(self, seq: int, limit: float, on_expire: Callable[[], None] | None = None) -> None:
        """Call ``seq``, running in the current task, must end within ``limit`` seconds;
        ``on_expire`` runs when it does not, just before its task is cancelled."""
        if limit == math.inf:
            return
        if on_expire is not None:
            self._on_expire[seq] = on_expire
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        at = loop.time() + limit
        self._running[seq] = (at, task, task.cancelling())
        if at < self._armed_at:
            self._arm(loop, at)

    def release(self, seq: int) -> bool:
        """Call ``seq`` ended; True if it was cancelled because its deadline passed (and
        nobody else cancelled its task meanwhile)."""
        entry = self._running.pop(seq, None)
        self._on_expire.pop(seq, None)
        if seq not in self._expired:
            return False
        self._expired.discard(seq)
        assert entry is not None
        _at, task, cancelling = entry
        return task.uncancel() <= cancelling

    def watched(self) -> list[int]:
        """The calls watched now (running, or expired and not released yet)."""
        return sorted(self._running.keys() | self._expired)

    @property
    def armed_at(self) -> float:
        """The loop time the timer fires at (inf: no timer armed)."""
        return self._armed_at

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._armed_at = None, math.inf

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._armed_at = loop.call_at(at, self._fire), at

    def _fire(self) -> None:
        self._timer, self._armed_at = None, math.inf
        loop = asyncio.get_running_loop()
        now = loop.time() + _SLACK
        following = math.inf
        for seq, (at, task, _cancelling) in self._running.items():
            if seq in self._expired:
                continue
            if at <= now:
                self._expired.add(seq)
                hook = self._on_expire.pop(seq, None)
                if hook is not None:
                    hook()
                task.cancel()
            else:
                following = min(following, at)
        if following < math.inf:
            self._arm(loop, following)
