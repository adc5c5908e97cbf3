"""Where one collective's time went, for traced jobs: waiting for peers, reducing, and
the rest, moving bytes.

Waiting is the time the call was suspended on a receive before that receive's payload
began to arrive (its header, or its shared-memory head, was read), and, on the node
arena, the time a program waited for other ranks' words. Concurrent waits (a direct
exchange awaits several receives at once) count once: they are merged as intervals.
Reducing is the time inside the reduction kernels. Moving is what is left of the call:
writing and reading payloads, copies, checksums, the event loop's share.

Only a traced job pays for this: without a tracer no call has a Split, and each place
that measures checks for one first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from shardwire.worker.kernels.reduce import ReduceOp, combine


class Split:
    """One call's waiting intervals and reduction time (see the module docstring)."""

    __slots__ = ("_intervals", "algorithm", "composed", "paths", "reduce_s", "wait_s")

    def __init__(self) -> None:
        self.paths: set[str] = set()  # what its sends went through: tcp, shm, memory
        self.algorithm = ""  # the message algorithm the call ran (ring, bruck, ...), if any
        # a call over several nodes runs as calls of its subgroups, split each on its own
        self.composed = False
        self.reduce_s = 0.0
        self.wait_s = 0.0  # measured as one figure (the arena's waits never overlap)
        self._intervals: list[tuple[float, float]] = []

    def waited(self, start: float, end: float) -> None:
        if end > start:
            self._intervals.append((start, end))

    def waiting(self) -> float:
        """Seconds spent waiting, overlapping intervals counted once."""
        return self.wait_s + _union(self._intervals)

    def combine(self, op: ReduceOp, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
        """:func:`~shardwire.worker.kernels.reduce.combine`, timed."""
        start = time.perf_counter()
        combine(op, first, second, out)
        self.reduce_s += time.perf_counter() - start


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def reduce_with(split: Split | None, op: ReduceOp, first, second, out) -> None:
    """``out = first (op) second``, timed into ``split`` when the job is traced."""
    if split is None:
        combine(op, first, second, out)
    else:
        split.combine(op, first, second, out)
