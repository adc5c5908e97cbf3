"""How long this process waited for communication: the time during which at least one
collective was being awaited (``await pg.all_reduce(...)``, ``await work.wait()``), or a
small node-arena call ran to its end where it was made (an express call).

Intervals are merged, so calls awaited inside other calls (hierarchical algorithms run
subgroup calls) or side by side (``asyncio.gather``) count once; a collective started in
the background counts only while something waits for it, which is the communication a
step did not hide. Only the event loop's thread touches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


class Waits:
    """Seconds spent awaiting collectives, merged over overlapping waits."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._total = 0.0
        self._active = 0
        self._since = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._total += self._clock() - self._since

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def seconds(self) -> float:
        """The total so far (a wait under way counts up to now)."""
        if self._active:
            return self._total + self._clock() - self._since
        return self._total


WAITS = Waits()  # this process's


def waited(coro: Coroutine[Any, Any, T]) -> Generator[Any, None, T]:
    """Run an awaited call, counting its time in :data:`WAITS`."""
    with WAITS:
        return (yield from coro.__await__())
