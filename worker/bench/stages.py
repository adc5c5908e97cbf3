"""What a long benchmark is doing and how far it is, on standard error (the tables stay
alone on standard output).

A benchmark counts its stages before it starts (a job, one system's run at one size)
and says when each begins, a line per stage:

    [slowlink] 4/24: 2 hosts, 1gbit, dp: 200 steps timed (3.2 min in; about 12 min left)

On a terminal the line ends in a tqdm bar of the work done. Each stage's bar is a line
of its own, not one bar redrawn in place: the jobs a stage starts write to the same
terminal, and their lines would run into a bar left open. In a log (standard error not
a terminal, or tqdm not installed) the line is plain.

The time left is the time spent over the work the finished stages did, times the work
still to do. A stage's work is 1 unless the benchmark knows better (the steps a run
trains), so that a long run after short ones is not taken for another short one. The
first stage has no estimate; closing says how long the whole took.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Stages", "duration"]

_BAR = "{desc} |{bar}|"  # the stage's line, then the bar to the terminal's width


def duration(seconds: float) -> str:
    """``seconds`` as a person reads them: ``40 s``, ``3.2 min``, ``25 min``, ``1.5 h``."""
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    if seconds < 597:
        return f"{seconds / 60:.1f} min"
    if seconds < 5970:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _tqdm() -> Any:
    """tqdm's bar, or None where the examples' extra (which brings it) is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Stages:
    """The stages of one benchmark run, ``total`` of them, announced one by one.

    Args:
        bench: the benchmark's name, which starts every line (``[goodput]``).
        total: the stages the run makes, counted before the first.
        work: the work of all of them together (the sum of every stage's ``work``;
            ``total`` when each is 1).
        out: where the lines go (standard error).
        terminal: end each line in a bar (``out.isatty()`` when None).
        clock: seconds, for the time spent and left (``time.monotonic``).
    """

    def __init__(
        self,
        bench: str,
        total: int,
        *,
        work: float | None = None,
        out: TextIO | None = None,
        terminal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bench, self.total = bench, total
        self.work = float(total if work is None else work)
        self.out = sys.stderr if out is None else out
        self.clock = clock
        self.started = clock()
        self.begun = 0  # stages started so far, the one running included
        self.finished_work = 0.0  # the work of the stages before the one running
        self._running_work = 0.0
        self.drawn = self.out.isatty() if terminal is None else terminal

    def start(self, what: str, *, work: float = 1.0) -> None:
        """Stage ``what`` begins (the one before it is finished); ``work``: its share of
        the total work."""
        assert self.begun < self.total, f"{self.bench}: stage {self.begun + 1} of {self.total}"
        self.finished_work += self._running_work
        self._running_work = work
        self.begun += 1
        self._show(f"[{self.bench}] {self.begun}/{self.total}: {what} ({self._timing()})")

    def close(self, *, finished: bool = True) -> None:
        """The run is over; ``finished``: every stage ran to its end (then the time it
        all took is said)."""
        if finished:
            self.finished_work += self._running_work
            self._running_work = 0.0
            stages = f"{self.begun} stage{'' if self.begun == 1 else 's'}"
            self._show(f"[{self.bench}] done: {stages} in {duration(self._spent())}")

    def _timing(self) -> str:
        spent = self._spent()
        said = f"{duration(spent)} in"
        if self.finished_work > 0:
            left = spent / self.finished_work * (self.work - self.finished_work)
            said += f"; about {duration(left)} left"
        return said

    def _show(self, text: str) -> None:
        drawing = _tqdm() if self.drawn else None
        if drawing is None:
            print(text, file=self.out, flush=True)
            return
        done = min(self.finished_work, self.work)
        bar = drawing(total=self.work, initial=done, desc=text, file=self.out, bar_format=_BAR)
        bar.close()  # drawn, and left on its own line

    def _spent(self) -> float:
        return self.clock() - self.started

    def __enter__(self) -> Stages:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close(finished=error is None)
