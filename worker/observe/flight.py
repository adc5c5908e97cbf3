"""The flight recorder: each rank's always-on ring buffer of its recent collectives.

Theory of operation: every collective adds an entry when it starts and closes it when
it ends (``ok``, ``timeout`` or the error). When a job hangs, the coordinator asks each
rank for the tail of this buffer; comparing the tails tells which rank never entered the
call the others are waiting in. Entries are written by the event loop and read by the
control thread, which must answer even while the loop is blocked, so the ring is the one
structure here shared between threads and it guards itself with a lock (a few hundred
nanoseconds per collective, next to tens of microseconds for the smallest one).

Which ranks a running call still waits for is asked of the call itself, and only on the
event loop (``snapshot(live=True)``); from another thread only the stored fields are read.

Timings: each collective that ends ``ok`` also leaves (group, size, seq, microseconds
from its start to its end) for the next heartbeat (:meth:`FlightRecorder.drain`), at most
TIMINGS of them. Every member of a collective ends it at about the same moment, so the
rank that spent the least time in it arrived last; the coordinator compares them
(``coordinator/stragglers.py``) and no clocks need aligning.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardwire.protocol.messages import CollectiveRecord
from shardwire.protocol.ranks import to_runs
from shardwire.worker.observe import trace

if TYPE_CHECKING:
    from shardwire.worker.observe.split import Split

CAPACITY = 32  # recent collectives kept per rank
SHOWN = 16  # the newest ones a diagnosis carries
_LISTED = 128  # groups larger than this are sent by size only (control frames are small)
TIMINGS = 512  # collectives' timings kept for the next heartbeat (the oldest are dropped)

Timing = tuple[int, int, int, int]  # group id, group size, sequence, microseconds

Pending = Callable[[], list[int]]


@dataclass(slots=True)
class _Entry:
    group: int
    ranks: tuple[int, ...]
    op: str
    seq: int
    nbytes: int
    start: float
    pending: Pending | None  # asked on the event loop only
    path: str = ""  # the backend that ran it: links, arena or tiered
    end: float | None = None
    outcome: str = "running"
    silent: tuple[int, ...] = ()  # not heard from, as of the end
    split: Split | None = None  # where its time went (traced jobs only)


class FlightRecorder:
    """A bounded, thread-safe log of recent collectives."""

    def __init__(self, capacity: int = CAPACITY, *, clock: Callable[[], float] = time.monotonic):
        self._ring: deque[_Entry] = deque(maxlen=capacity)
        self._done: deque[Timing] = deque(maxlen=TIMINGS)
        self._lock = threading.Lock()
        self._clock = clock

    def begin(
        self,
        *,
        group: int,
        ranks: Sequence[int],
        op: str,
        seq: int,
        nbytes: int,
        pending: Pending | None = None,
        path: str = "",
    ) -> _Entry:
        """Record that a collective started; returns the entry to :meth:`end`."""
        entry = _Entry(group, tuple(ranks), op, seq, nbytes, self._clock(), pending, path)
        with self._lock:
            self._ring.append(entry)
        return entry

    def clock(self) -> float:
        return self._clock()

    def ended(
        self,
        *,
        group: int,
        ranks: tuple[int, ...],
        op: str,
        seq: int,
        nbytes: int,
        start: float,
        split: Split | None = None,
        path: str = "",
    ) -> None:
        """Record a collective that started at ``start`` and ended ``ok`` just now (one
        entry, one lock: the cost of a call that ran to its end at once)."""
        now = self._clock()
        entry = _Entry(group, ranks, op, seq, nbytes, start, None, path, now, "ok", (), split)
        with self._lock:
            self._ring.append(entry)
            self._done.append((group, len(ranks), seq, round((now - start) * 1e6)))
        _traced(entry)

    def end(
        self,
        entry: _Entry,
        outcome: str = "ok",
        *,
        silent: Sequence[int] = (),
        split: Split | None = None,
    ) -> None:
        """Record how a collective ended (``silent``: ranks never heard from; ``split``:
        where its time went, in a traced job)."""
        entry.split = split
        with self._lock:
            entry.end = end = self._clock()
            entry.outcome = outcome[:200]
            entry.silent = tuple(silent)
            entry.pending = None
            if outcome == "ok":
                micros = round((end - entry.start) * 1e6)
                self._done.append((entry.group, len(entry.ranks), entry.seq, micros))
        _traced(entry)

    def drain(self) -> list[Timing]:
        """The timings of the collectives ended since the last drain (any thread)."""
        with self._lock:
            done = list(self._done)
            self._done.clear()
        return done

    def snapshot(self, *, live: bool, limit: int = SHOWN) -> list[CollectiveRecord]:
        """The newest entries, oldest first. ``live=True`` only on the loop that writes them."""
        now = self._clock()
        with self._lock:
            entries = [
                (e.group, e.ranks, e.op, e.seq, e.nbytes, e.start, e.end, e.outcome, e.silent)
                + (e.pending,)
                for e in list(self._ring)[-limit:]
            ]
        records = []
        for group, ranks, op, seq, nbytes, start, end, outcome, silent, pending in entries:
            waiting = list(silent)
            if end is None and live and pending is not None:
                waiting = pending()
            records.append(
                CollectiveRecord(
                    group=group,
                    size=len(ranks),
                    ranks=list(ranks) if len(ranks) <= _LISTED else [],
                    runs=(to_runs(ranks) or []) if len(ranks) > _LISTED else [],
                    op=op,
                    seq=seq,
                    nbytes=nbytes,
                    age_s=round(now - start, 3),
                    duration_s=None if end is None else round(end - start, 3),
                    outcome=outcome,
                    pending=waiting[:_LISTED],
                )
            )
        return records


def _traced(entry: _Entry) -> None:
    """Put an ended collective on the rank's timeline, when the job is traced."""
    tracer = trace.current()
    if tracer is None or entry.end is None:
        return
    args = {
        "group": entry.group,
        "size": len(entry.ranks),
        "seq": entry.seq,
        "bytes": entry.nbytes,
        "path": entry.path,
        "outcome": entry.outcome,
    }
    split = entry.split
    if split is not None:
        # the arena runs one program per op; a call over nodes runs its subgroups' calls
        how = "hierarchical" if split.composed else split.algorithm or entry.path
        args["algorithm"] = how
        if split.paths and entry.path != "arena":  # the links it used: tcp, shm or both
            args["path"] = "+".join(sorted(split.paths))
        if not split.composed:
            args.update(split_ms(split, entry.end - entry.start))
    key = f"{entry.group}:{entry.seq}"
    tracer.add(entry.op, "collective", entry.start, entry.end, args, key=key)


def split_ms(split: Split, duration: float) -> dict[str, float]:
    """A call's ``duration`` as milliseconds waiting for peers, reducing and moving
    bytes (the rest); the three add up to the duration."""
    wait = min(split.waiting(), duration)
    reduce = min(split.reduce_s, duration - wait)
    return {
        "wait_ms": round(wait * 1e3, 3),
        "reduce_ms": round(reduce * 1e3, 3),
        "move_ms": round((duration - wait - reduce) * 1e3, 3),
    }
