"""Runs a group's arena programs in call order, on the event loop or on one thread.

Theory of operation
-------------------
Programs are queued when their calls are made, so they run in call order whichever
call is awaited first. Whoever finds the engine idle drives the queue from its head:

* the event loop, *inline*, while every wait of a program is satisfied within the spin
  budget (peers that arrive within microseconds: no thread hop, no loop wake-up);
* the engine's thread, once a wait is not: the loop hands the queue over and awaits
  the call's future, so it keeps running other tasks (prefetch, heartbeats, other
  groups) while the thread sleeps on the futex. The thread drives until the queue is
  empty, then idles and the next call is driven inline again.
* the engine's thread at once, for a call started in the background (``hurry``): a
  prefetch then moves its data while the loop computes, not when the loop next awaits.

A small call made while the engine is idle runs as soon as it is made (``express``):
no queue, no future, no task. Its waits spin for the budget and may then sleep on the
futex on the loop's own thread for ``nap`` seconds (a node with more ranks than CPUs,
where spinning steals the time slices of the ranks it waits for); a call still waiting
after that heads the queue and the thread drives it like any other.

On such a crowded node every wait on the loop (an express call's, or a queued call's
driven inline) first polls briefly, yielding the CPU, while the ranks it waits for are
between calls rather than computing (``Board.spin_inside``): they publish as soon as
they get a CPU, and the yield hands them one.

numpy copies and reductions release the GIL for arrays of any size that matters, and
the thread's spin yields the CPU between polls, so a thread waiting for peers does not
hold up the loop's compute. The thread is owned by the engine: :meth:`Engine.close`
stops and joins it. Futures cross from the thread to the loop only through
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time

from shardwire.protocol.errors import InvalidState
from shardwire.worker.arena.board import Board, Poisoned, Stalled
from shardwire.worker.arena.peerread import ReadFailed
from shardwire.worker.arena.programs import Mismatch, Need, Program
from shardwire.worker.observe.split import Split

_THREAD_SPIN = 50e-6  # the thread polls this long (yielding the CPU) before it sleeps
_RELEASE_WAIT = 5.0  # a cancelled call waits this long for the engine to let go of it
# A wait on the loop on a crowded node polls this long (yielding the CPU) for peers
# between the previous call and this one before it sleeps or hands over to the thread:
# such a peer publishes as soon as it gets a CPU, and the yield hands it one without a
# futex wake and two context switches. 4 ranks on 2 cores, 4 KiB all_reduce back to
# back: 41 us a call against 80-94 sleeping, and half the CPU; with compute between
# calls, faster and no dearer.
INSIDE_SPIN = 100e-6


class Abandoned(Exception):
    """The call's caller went away (cancelled); its program stops at its next wait."""


class Job:
    """One queued program and its outcome. The futures are made only when somebody
    waits for a job the loop did not finish inline (a future costs microseconds)."""

    __slots__ = (
        "abandoned",
        "deadline",
        "error",
        "finished",
        "future",
        "late",
        "need",
        "need_at",
        "program",
        "seq",
        "released",
        "split",
    )

    def __init__(self, program: Program, deadline: float, split: Split | None = None, seq: int = 0):
        self.program = program
        self.seq = seq  # the group's call number (0 if not known)
        self.deadline = deadline
        self.split = split  # the call's: its waits are timed into it (traced jobs only)
        self.need: Need | None = None
        self.need_at = 0.0  # when the program yielded ``need`` (timed jobs only)
        self.error: BaseException | None = None
        self.abandoned = False
        self.finished = False  # set under the engine's lock
        self.late: list[int] = []  # local ranks it waited for when its caller gave up
        self.future: asyncio.Future[None] | None = None
        self.released: asyncio.Future[None] | None = None


class Engine:
    """The queue of one arena's programs and the two ways of driving it."""

    def __init__(
        self,
        board: Board,
        *,
        spin: float,
        yield_cpu: bool,
        name: str,
        nap: float = 0.0,
        inside: float = INSIDE_SPIN,
    ) -> None:
        self.board = board
        self.spin = spin  # inline polling budget, seconds (0 on a crowded node)
        self.yield_cpu = yield_cpu
        self.nap = nap  # an express call's wait may then sleep this long on the loop
        self.inside = inside  # ... after polling this long for peers between calls
        self.inline_runs = 0  # programs finished on the loop, for tests and stats
        self.thread_runs = 0  # programs finished on the thread
        self._name = name
        self._queue: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()  # taken alone where nobody is notified (cheaper)
        self._cv = threading.Condition(self._lock)
        self._driver: str | None = None  # None (idle), "loop" or "thread"
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def driver(self) -> str | None:
        """Who drives the queue now: None (idle), "loop" or "thread"."""
        return self._driver

    def submit(
        self, program: Program, deadline: float, split: Split | None = None, seq: int = 0
    ) -> Job:
        """Queue ``program`` (call order is queue order)."""
        job = Job(program, deadline, split, seq)
        with self._cv:
            if self._closed:
                raise InvalidState("the arena engine is closed")
            self._queue.append(job)
        return job

    def claim(self) -> bool:
        """Make the loop the driver if the engine is idle (True): the caller then builds
        a program and hands it to :meth:`express` at once. False: queue the call with
        :meth:`submit`."""
        if self._driver is not None:  # read without the lock: only the loop sets it
            return False  # from None, and a stale "busy" only sends a call to the queue
        with self._lock:
            if self._driver is not None or self._queue or self._closed:
                return False
            self._driver = "loop"
        return True

    def express(
        self, program: Program, deadline: float, split: Split | None = None, seq: int = 0
    ) -> Job:
        """Run ``program`` at once on the loop (after :meth:`claim`). The job comes back
        finished when every wait was met within the spin budget (or the nap); otherwise
        it heads the queue and the thread drives it, and :meth:`run` waits for it like
        any other."""
        job = Job(program, deadline, split, seq)
        if self._advance(job, blocking=False, nap=self.nap):
            job.finished = True
            self.inline_runs += 1
            self._driver = None  # only the loop sets a driver on an idle engine
            return job
        with self._cv:
            self._queue.append(job)
            self._driver = "thread"
            self._start_thread()
            self._cv.notify()
        return job

    def hurry(self) -> None:
        """Have the thread drive the queue now if nobody does (a call started in the
        background): its work overlaps whatever the loop runs until it is awaited."""
        with self._cv:
            if self._driver is None and self._queue and not self._closed:
                self._driver = "thread"
                self._start_thread()
                self._cv.notify()

    async def run(self, job: Job) -> None:
        """Drive the queue if idle, then wait for ``job``; raises the program's error."""
        with self._cv:
            drive = self._driver is None
            if drive:
                self._driver = "loop"
        if drive:
            self._drive_inline()
        with self._cv:
            waiting = not job.finished
            if waiting:
                job.future = self._loop.create_future()
                job.released = self._loop.create_future()
        if waiting:
            assert job.future is not None and job.released is not None
            try:
                await job.future
            except asyncio.CancelledError:
                job.late = self.lagging(job)  # before the program lets go of its wait
                job.abandoned = True
                self.kick()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_RELEASE_WAIT):
                        await asyncio.shield(job.released)
                raise
        if job.error is not None:
            raise job.error

    def lagging(self, job: Job) -> list[int]:
        """The local ranks ``job`` is waiting for now (empty if it waits for nobody)."""
        need = job.need
        if need is None:
            return []
        return [r for r in need.ranks if self.board.lagging(need.word, (r,), need.target) >= 0]

    def kick(self) -> None:
        """Wake the thread if it sleeps on a futex (it then re-checks its job)."""
        for row in self.board.rows:
            self.board.words.wake(row)

    # ---- driving ------------------------------------------------------------------------

    def _drive_inline(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._driver = None
                    return
                job = self._queue[0]
            if not self._advance(job, blocking=False):
                with self._cv:
                    self._driver = "thread"
                    self._start_thread()
                    self._cv.notify()
                return
            with self._cv:
                self._queue.popleft()
                job.finished = True
            self.inline_runs += 1
            self._settle(job)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while self._driver != "thread" and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    self._driver = None
                    if self._closed:
                        return
                    continue
                job = self._queue[0]
            self._advance(job, blocking=True)
            with self._cv:
                self._queue.popleft()
                job.finished = True
            self.thread_runs += 1
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._settle, job)

    def _napped(self, need: Need, nap: float, job: Job) -> bool:
        """Whether ``need`` was met on this thread before the engine's thread takes over:
        on a node with more ranks than CPUs (``yield_cpu``) it is polled for first while
        the ranks waited for are between calls (``inside`` seconds), then slept for up
        to ``nap`` seconds. Neither when a rank waited for runs in this process: this
        thread may be the one that would run it."""
        board = self.board
        if (nap <= 0 and not self.yield_cpu) or board.beside(need.ranks):
            return False  # (the first test keeps an uncrowded node's miss cheap)
        now = time.monotonic()
        if (
            self.yield_cpu
            and job.seq
            and board.spin_inside(need.word, need.ranks, need.target, job.seq, now + self.inside)
        ):
            return True
        if nap <= 0:
            return False
        return board.wait(need.word, need.ranks, need.target, job.deadline, until=now + nap)

    def _advance(self, job: Job, *, blocking: bool, nap: float = 0.0) -> bool:
        """Run ``job`` until it ends (True) or, not ``blocking``, until a wait is not met
        within the spin budget and then ``nap`` (False)."""
        board = self.board
        spin = self.spin if not blocking else _THREAD_SPIN
        try:
            while True:
                need = job.need
                if need is not None:
                    if not board.spin(
                        need.word, need.ranks, need.target, spin, self.yield_cpu or blocking
                    ):
                        if not blocking and not self._napped(need, nap, job):
                            return False
                        stop = lambda: job.abandoned or self._closed  # noqa: E731
                        if not board.wait(need.word, need.ranks, need.target, job.deadline, stop):
                            raise Abandoned("the call was abandoned")
                    job.need = None
                    if job.split is not None:
                        job.split.wait_s += time.monotonic() - job.need_at
                if job.abandoned or self._closed:
                    raise Abandoned("the call was abandoned")
                job.need = job.program.send(None)
                if job.split is not None:
                    job.need_at = time.monotonic()
        except StopIteration:
            return True
        except (Poisoned, Stalled, Mismatch, Abandoned, ReadFailed) as exc:
            # Expected ends: no traceback, whose frames would keep views of the region
            # (and so its mapping) alive for as long as the caller keeps the error.
            job.error = exc.with_traceback(None)
            job.program.close()
            return True
        except BaseException as exc:  # handed to the caller through its future
            job.error = exc
            job.program.close()
            return True

    @staticmethod
    def _settle(job: Job) -> None:
        """On the loop: wake whoever waits for ``job`` (its outcome is on the job)."""
        if job.future is not None and not job.future.done():
            job.future.set_result(None)
        if job.released is not None and not job.released.done():
            job.released.set_result(None)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    # ---- closing ------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> bool:
        """Abandon queued programs, stop and join the thread; False if it did not stop."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.abandoned = True
            self._cv.notify_all()
        self.kick()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        for job in list(self._queue):
            job.error = job.error or Abandoned("the arena was closed")
            job.finished = True
            self._settle(job)
        self._queue.clear()
        return True
