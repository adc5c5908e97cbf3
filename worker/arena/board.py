"""The arena's control rows: publishing progress, waiting for it, and poisoning.

Every local rank owns one row and is the only writer of it (except the abort path):

* ``ready``: the arena's logical clock value at this rank's last publish of data (a
  rank publishes the absolute value, so a rank that skips a publish stays consistent);
* ``done``: the last global chunk number this rank has finished reading;
* ``sig``: the signature of the call it wrote into each half (call sequence number and
  a CRC of the call's signature), which readers compare with their own;
* ``bell`` and ``sleepers``: the futex word sleepers wait on, and whether anyone may
  (see ``atomics``);
* ``entered``: the sequence number of the last call this rank made in its group (read
  only to name the ranks that never made a call when it times out);
* ``pid``: the process this rank runs in (a wait does not sleep the thread of a process
  whose own ranks it waits for);
* ``poisoned`` and ``cause``: set when this rank poisoned the arena, with the error
  (kind, message, failed rank) that every other local rank then raises.

Waiting for a word spins for a budget (a receive that arrives within microseconds
saves a kernel sleep and wake-up), then sleeps on the owner's bell in slices, checking
the abort word and the deadline between slices.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable, Sequence

from shardwire.protocol.codec import pack_object, unpack_object
from shardwire.worker.arena.atomics import Words
from shardwire.worker.arena.region import ABORT, ROW_BYTES, Region

BELL, SLEEPERS, READY, DONE, SIG, POISONED, CAUSE_LEN, ENTERED, PID, CAUSE = (
    0,
    4,
    8,
    16,
    24,
    40,
    44,
    48,
    56,
    64,
)
CAUSE_BYTES = ROW_BYTES - CAUSE
_MASK = (1 << 64) - 1
_BELL_MASK = (1 << 31) - 1
_HALF = 1 << 63
_SLICE = 0.25  # a sleeper re-checks abort and deadline at least this often


def reached(value: int, target: int) -> bool:
    """``value >= target`` on the 64-bit wrapping clock."""
    return ((value - target) & _MASK) < _HALF


class Poisoned(Exception):
    """The arena was poisoned; ``cause`` is what the poisoning rank recorded."""

    def __init__(self, rank: int, cause: dict) -> None:
        super().__init__(f"local rank {rank} poisoned the arena: {cause.get('m', '')}")
        self.rank = rank
        self.cause = cause


class Stalled(TimeoutError):
    """A wait passed its deadline; ``ranks`` are the local ranks not heard from."""

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"local ranks {ranks} did not arrive")
        self.ranks = ranks


class Board:
    """One rank's view of the control rows of a region."""

    def __init__(self, region: Region, me: int, *, plain: bool | None = None) -> None:
        g = region.geometry
        size = g.row(g.ranks)  # the header page and the rows
        self.words = Words(region.base, size, **({} if plain is None else {"plain": plain}))
        self.k = g.ranks
        self.me = me
        self.rows = [g.row(r) for r in range(self.k)]
        self.mine = self.rows[me]
        self.others = [r for r in range(self.k) if r != me]
        self._bell = self.words.pointer(self.mine + BELL)
        self.words.exchange32(self.mine + PID, os.getpid())

    # ---- publishing ---------------------------------------------------------------------

    def publish(self, word: int, value: int) -> None:
        """Store ``value`` into this rank's ``word`` (READY or DONE) and ring the bell."""
        w, row = self.words, self.mine
        if w.plain:  # the hot path: a prebuilt array's item, no method calls
            w.u64[(row + word) >> 3] = value & _MASK
            w.swap(self._bell, (w.u32[row >> 2] + 1) & _BELL_MASK)  # any change wakes
            if not w.u32[(row + SLEEPERS) >> 2]:
                return
        else:
            w.store(row + word, value & _MASK)
            w.swap(self._bell, (w.load32(row + BELL) + 1) & _BELL_MASK)
            if not w.load32(row + SLEEPERS):
                return
        w.exchange32(row + SLEEPERS, 0)
        w.wake(row + BELL)

    def enter(self, seq: int) -> None:
        """Record that this rank has made call ``seq`` of its group."""
        self.words.store(self.mine + ENTERED, seq & _MASK)

    def absent(self, seq: int) -> list[int]:
        """The other local ranks that have not made call ``seq`` yet."""
        load, rows = self.words.load, self.rows
        return [r for r in self.others if not reached(load(rows[r] + ENTERED), seq)]

    def sign(self, half: int, signature: int) -> None:
        self.words.store(self.mine + SIG + 8 * half, signature & _MASK)

    def signature(self, rank: int, half: int) -> int:
        return self.words.load(self.rows[rank] + SIG + 8 * half)

    def unsigned(self, ranks: Sequence[int], half: int, signature: int) -> int:
        """The first of ``ranks`` whose ``half`` is not signed ``signature``, or -1."""
        rows, word = self.rows, SIG + 8 * half
        if self.words.plain:
            u64 = self.words.u64
            for r in ranks:
                if u64[(rows[r] + word) >> 3] != signature:
                    return r
            return -1
        load = self.words.load
        for r in ranks:
            if load(rows[r] + word) != signature:
                return r
        return -1

    def beside(self, ranks: Sequence[int]) -> bool:
        """Whether any of ``ranks`` runs in this very process."""
        pid, load32, rows = os.getpid(), self.words.load32, self.rows
        return any(load32(rows[r] + PID) == pid for r in ranks)

    def value(self, rank: int, word: int) -> int:
        return self.words.load(self.rows[rank] + word)

    # ---- waiting ------------------------------------------------------------------------

    def lagging(self, word: int, ranks: Sequence[int], target: int) -> int:
        """The first of ``ranks`` whose ``word`` has not reached ``target``, or -1."""
        rows = self.rows
        if self.words.plain:  # the hot path: indexing a prebuilt array
            u64 = self.words.u64
            for r in ranks:
                if ((u64[(rows[r] + word) >> 3] - target) & _MASK) >= _HALF:
                    return r
            return -1
        load = self.words.load
        for r in ranks:
            if not reached(load(rows[r] + word), target):
                return r
        return -1

    def spin(
        self, word: int, ranks: Sequence[int], target: int, budget: float, yield_cpu: bool
    ) -> bool:
        """Poll up to ``budget`` seconds; True once every rank reached ``target``."""
        if self.lagging(word, ranks, target) < 0:
            return True
        if budget <= 0:
            return False
        end = time.perf_counter() + budget
        while time.perf_counter() < end:
            if self.lagging(word, ranks, target) < 0:
                return True
            self.check_abort()
            if yield_cpu:
                os.sched_yield()
        return self.lagging(word, ranks, target) < 0

    def spin_inside(
        self, word: int, ranks: Sequence[int], target: int, seq: int, until: float
    ) -> bool:
        """Poll, yielding the CPU between looks, while every rank still lagging has made
        call ``seq - 1`` at least (it is between that call and this one, or inside this
        one, and publishes as soon as it runs), until the monotonic time ``until``; True
        once every rank reached ``target``. False at once when a lagging rank has not
        made call ``seq - 1``: it is further behind, and a poll here would take the CPU
        it needs."""
        rows, load = self.rows, self.words.load
        while True:
            r = self.lagging(word, ranks, target)
            if r < 0:
                return True
            if not reached(load(rows[r] + ENTERED), seq - 1) or time.monotonic() >= until:
                return False
            self.check_abort()
            os.sched_yield()

    def wait(
        self,
        word: int,
        ranks: Sequence[int],
        target: int,
        deadline: float,
        stop: Callable[[], bool] = lambda: False,
        *,
        until: float = math.inf,
    ) -> bool:
        """Block until every rank's ``word`` reached ``target`` (True), or until ``stop()``
        (False, checked after every sleep) or the monotonic time ``until`` (False);
        raises Poisoned, or Stalled at ``deadline``."""
        w = self.words
        while True:
            r = self.lagging(word, ranks, target)
            if r < 0:
                return True
            if stop():
                return False
            now = time.monotonic()
            if now >= until:
                return False
            row = self.rows[r]
            w.exchange32(row + SLEEPERS, 1)
            bell = w.load32(row + BELL)
            if reached(w.load(row + word), target):
                continue
            self.check_abort()
            remaining = deadline - now
            if remaining <= 0:
                raise Stalled(
                    [q for q in ranks if not reached(w.load(self.rows[q] + word), target)]
                )
            w.sleep(row + BELL, bell, min(remaining, until - now, _SLICE))

    # ---- poisoning ----------------------------------------------------------------------

    def aborted(self) -> bool:
        return bool(self.words.load32(ABORT))

    def check_abort(self) -> None:
        if self.words.load32(ABORT):
            raise self.poisoned()

    def poisoned(self) -> Poisoned:
        """The cause recorded by the lowest poisoning rank (this one if none wrote it)."""
        for r in range(self.k):
            row = self.rows[r]
            if self.words.load32(row + POISONED):
                return Poisoned(r, self._cause(row))
        return Poisoned(self.me, {"k": "CollectiveError", "m": "the node arena was aborted"})

    def poison(self, cause: dict) -> None:
        """Record ``cause`` (kind ``k``, message ``m``, failed rank ``r``), raise the abort
        word and wake every sleeper of every row. Idempotent per rank."""
        w, row = self.words, self.mine
        if not w.load32(row + POISONED):
            data = pack_object(_fit(cause))
            _view(w.base + row + CAUSE, len(data))[:] = data
            w.exchange32(row + CAUSE_LEN, len(data))
            w.exchange32(row + POISONED, 1)
        w.exchange32(ABORT, 1)
        for other in self.rows:
            w.add32(other + BELL, 1 << 16)
            w.wake(other + BELL)

    def _cause(self, row: int) -> dict:
        length = self.words.load32(row + CAUSE_LEN)
        if not 0 < length <= CAUSE_BYTES:
            return {"k": "CollectiveError", "m": "the node arena was poisoned (no cause recorded)"}
        raw = bytes(_view(self.words.base + row + CAUSE, length))
        try:
            cause = unpack_object(raw)
        except Exception:  # a torn or foreign cause: still an abort, without the text
            return {"k": "CollectiveError", "m": "the node arena was poisoned (cause unreadable)"}
        return cause if isinstance(cause, dict) else {"k": "CollectiveError", "m": str(cause)}


def _view(address: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


def _fit(cause: dict) -> dict:
    """Shorten the message until the packed cause fits a row."""
    cause = dict(cause)
    message = str(cause.get("m", ""))
    while len(pack_object({**cause, "m": message})) > CAUSE_BYTES:
        message = message[: max(0, len(message) - 64)]
    cause["m"] = message
    return cause
