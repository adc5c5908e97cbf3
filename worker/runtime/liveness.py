"""Liveness the user's code cannot break: the control connection on its own thread.

Theory of operation
-------------------
User code blocks its event loop (imports, numpy, data loading, a GC pause), so
heartbeats sent from that loop would let a healthy, busy rank be declared dead. The
control connection to the coordinator therefore runs on a small event loop in a thread
that :class:`ControlThread` owns: it sends heartbeats, answers diagnosis requests and
receives aborts whatever the user's loop is doing. What still fails a job: a dead
process (its connection closes), a stopped process or host (its heartbeats stop), a
rank that never arrives at a collective (``CollectiveTimeout`` on the others).

A watchdog rides on the heartbeats: the user's loop runs a ticker every 0.2 s, and when
the ticker has not run for ``stall_warn`` seconds each heartbeat carries how long the
loop has been busy and the loop thread's stack. A stall is shown, never acted upon.

Every crossing between the two threads is in this module: the user's loop hands work to
the control loop with ``run_coroutine_threadsafe`` / ``call_soon_threadsafe`` and gets
aborts and live diagnoses back the same way. The one exception is the ticker's
timestamp, a single float written by the user's loop and read by the watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from shardwire.protocol import Token
from shardwire.protocol.linkreports import LINKS_PER_BEAT, LinkReport
from shardwire.protocol.messages import Abort, Diagnosis, Heartbeat, Join
from shardwire.protocol.placement import Member, Placement
from shardwire.worker.observe.flight import FlightRecorder
from shardwire.worker.runtime import stacks
from shardwire.worker.runtime.beats import BeatRelay
from shardwire.worker.runtime.control import ControlClient

T = TypeVar("T")
log = logging.getLogger("shardwire.worker")

_TICK = 0.2  # how often the user's loop proves it runs
_LIVE_WAIT = 1.0  # how long a diagnosis waits for the user's loop before reading the thread
_CLOSE_WAIT = 5.0  # bound on closing the control connection and joining the thread
_TASKS = 8  # tasks whose stacks a diagnosis shows


class ControlThread:
    """The worker's control connection, heartbeats and stall watchdog on a thread.

    Use from the user's event loop: ``connect``, ``join``, the reporting methods and
    ``aclose`` (which stops and joins the thread). ``on_abort`` runs on the user's loop,
    and so does ``on_coordinator``: with True when the coordinator went away mid-job and
    this worker waits for its return, False once it took this worker back, and the wall
    clock time at which the control loop saw it.
    """

    def __init__(
        self,
        *,
        token: Token,
        run_id: str,
        heartbeat_interval: float,
        stall_warn: float,
        recorder: FlightRecorder,
        on_abort: Callable[[Abort | None], None],
        on_coordinator: Callable[[bool, float], None] = lambda _away, _at: None,
        tls: ssl.SSLContext | None = None,
        generation: int = 0,
        links: Callable[[], list[LinkReport]] | None = None,
    ):
        self._token = token
        self._generation = generation
        self._tls = tls
        self._run_id = run_id
        self._interval = heartbeat_interval
        self._stall_warn = stall_warn
        self._recorder = recorder
        self._on_abort = on_abort
        self._on_coordinator = on_coordinator
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="shardwire-control", daemon=True)
        self._client: ControlClient | None = None
        self._user_loop: asyncio.AbstractEventLoop | None = None
        self._user_thread = 0
        self._seen = time.monotonic()  # written by the user's loop only
        self._ticker: asyncio.TimerHandle | None = None
        self._verdict: asyncio.Future[Abort | None] | None = None
        # the peer links that moved: read on the user's loop once per heartbeat interval,
        # kept on the control loop until a heartbeat carries them
        self._links = links
        self._links_due = 0.0
        self._moved: dict[tuple[int, str], LinkReport] = {}
        self._relay_to: BeatRelay | None = None  # heartbeats through the node agent

    # ---- the thread ---------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the control loop; await its result from the user's loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the control loop, in order with every other post."""
        if self._thread.is_alive() and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    def _to_user(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._user_loop is not None:
            with contextlib.suppress(RuntimeError):  # the user's loop already closed
                self._user_loop.call_soon_threadsafe(fn, *args)

    # ---- used from the user's loop ------------------------------------------------------

    async def connect(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        relay: tuple[str, int, int] | None = None,
        replicas: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Start the thread, connect and authenticate, start heartbeats and the ticker.
        ``relay``: (socket path, rank, generation) of this worker under a node agent,
        whose socket then carries the heartbeats (``worker/runtime/beats.py``); if it
        cannot be reached, they go to the coordinator directly. ``replicas``: the
        coordinator's other replicas' addresses (etcd)."""
        self._user_loop = asyncio.get_running_loop()
        self._user_thread = threading.get_ident()
        self._verdict = self._user_loop.create_future()
        self._thread.start()
        self._tick()
        await self._call(self._connect(host, port, timeout, relay, replicas))

    async def join(self, msg: Join, *, timeout: float) -> Placement:
        """Join and wait for this worker's placement (bounded by ``timeout``)."""
        client = self._client
        assert client is not None
        return await self._call(client.join(msg, timeout=timeout))

    async def peers(self, ranks: list[int], *, timeout: float) -> list[Member]:
        """The members with ``ranks``, from the coordinator (each query bounded)."""
        client = self._client
        assert client is not None
        return await self._call(client.peers(ranks, timeout=timeout))

    async def clock_offset(self, *, probes: int = 5, timeout: float = 10.0) -> tuple[float, float]:
        """The coordinator's clock minus this process's monotonic clock, and its error."""
        client = self._client
        assert client is not None
        return await self._call(client.clock_offset(probes=probes, timeout=timeout))

    def placed(self, generation: int) -> None:
        """The generation this worker was placed in: its relayed heartbeats carry it (a
        survivor re-forming joins not knowing which generation forms)."""
        self._post(self._set_generation, generation)

    def _set_generation(self, generation: int) -> None:
        if self._relay_to is not None:
            self._relay_to.generation = generation

    def set_progress(self, progress: Heartbeat) -> None:
        """Report progress now and in every later heartbeat."""
        if self._client is not None:
            self._post(self._client.set_progress, progress)

    def report_failure(
        self, reason: str, traceback: str, *, code: str = "", diagnosis: Diagnosis | None = None
    ) -> None:
        if self._client is not None:
            report = self._client.report_failure
            self._post(functools.partial(report, reason, traceback, code=code, diagnosis=diagnosis))

    def report_peer_failure(self, rank: int, reason: str) -> None:
        if self._client is not None:
            self._post(self._client.report_peer_failure, rank, reason)

    def leave(self) -> None:
        if self._client is not None:
            self._post(self._client.leave)

    async def wait_verdict(self, timeout: float) -> Abort | None:
        """Wait (bounded) for the coordinator's abort after this rank reported a failure."""
        if self._verdict is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._verdict)
        return None

    def diagnosis(self) -> Diagnosis:
        """This rank's diagnosis, taken on the user's loop (which must be running it)."""
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        task_stacks = [(f"task {t.get_name()}", stacks.task_stack(t)) for t in tasks]
        task_stacks.sort(key=lambda item: not stacks.has_user_frame(item[1]))
        skip = {threading.get_ident(), self._thread.ident or 0}
        sections = stacks.busy_threads(skip=skip) + task_stacks[:_TASKS]
        mine = [stack for _title, stack in sections if stacks.has_user_frame(stack)]
        return Diagnosis(
            collectives=self._recorder.snapshot(live=True),
            where=stacks.place(mine[0]) if mine else "",
            stack=stacks.render(sections),
        )

    async def aclose(self) -> None:
        """Close the connection and stop and join the thread (bounded)."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if not self._thread.is_alive():
            if self._thread.ident is None:  # never started
                self._loop.close()
            return
        # a last word kept while the coordinator is away waits (bounded) for its return;
        # asked on the control loop, after what was posted before (the leave, above all:
        # on a busy machine it may not have run yet)
        extra = 0.0
        if self._client is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_WAIT):
                    extra = await self._call(self._closing_bound())
        try:
            async with asyncio.timeout(_CLOSE_WAIT + extra):
                await self._call(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join, _CLOSE_WAIT)

    def _tick(self) -> None:
        now = time.monotonic()
        stalled = now - self._seen >= self._stall_warn
        self._seen = now  # before the beat below is composed on the other thread
        if stalled and self._client is not None:  # say at once that the stall is over
            self._post(functools.partial(self._client.beat, direct=True))
        if self._links is not None and now >= self._links_due:
            self._links_due = now + self._interval
            moved = self._links()
            if moved:
                self._post(self._keep_links, moved)
        assert self._user_loop is not None
        self._ticker = self._user_loop.call_later(_TICK, self._tick)

    def _deliver(self, msg: Abort | None) -> None:
        if self._verdict is not None and not self._verdict.done():
            self._verdict.set_result(msg)
        self._on_abort(msg)

    # ---- on the control loop ------------------------------------------------------------

    async def _connect(
        self,
        host: str,
        port: int,
        timeout: float,
        relay: tuple[str, int, int] | None,
        replicas: Sequence[tuple[str, int]],
    ) -> None:
        client = ControlClient(
            token=self._token,
            run_id=self._run_id,
            role="worker",
            generation=self._generation,
            on_abort=lambda msg: self._to_user(self._deliver, msg),
            # the time is taken here: the user's loop may be busy when the news arrives
            on_coordinator=lambda away: self._to_user(self._on_coordinator, away, time.time()),
            on_diagnose=self._diagnose,
            tls=self._tls,
        )
        self._client = client
        await client.connect(host, port, timeout=timeout, replicas=replicas)
        if relay is not None:
            await self._relay(*relay)
        client.start_heartbeats(self._interval, compose=self._compose)

    async def _relay(self, path: str, rank: int, generation: int) -> None:
        assert self._client is not None
        try:
            self._relay_to = await BeatRelay.open(path, rank, generation, timeout=_CLOSE_WAIT)
        except (OSError, TimeoutError) as exc:
            log.warning(
                "rank %d: cannot reach the node agent's heartbeat socket %s (%s); sending "
                "heartbeats to the coordinator directly",
                rank,
                path,
                exc,
            )
            return
        self._client.relay(self._relay_to)

    async def _closing_bound(self) -> float:
        assert self._client is not None
        return self._client.closing_bound()

    async def _shutdown(self) -> None:
        # the client first: its heartbeats stop before the relay they go through closes
        if self._client is not None:
            await self._client.aclose()
        if self._relay_to is not None:
            self._relay_to.close()

    def _keep_links(self, moved: list[LinkReport]) -> None:
        for report in moved:  # a link's newest totals replace the older ones
            self._moved[(report.peer, report.path)] = report

    def _compose(self, progress: Heartbeat) -> Heartbeat:
        """The heartbeat: progress, the timings of the collectives ended since the last
        one (for straggler attribution), the peer links that moved, and where the event
        loop is if it is busy."""
        timings = self._recorder.drain()
        links = []
        for key in list(self._moved)[:LINKS_PER_BEAT]:
            links.append(self._moved.pop(key))
        busy = time.monotonic() - self._seen
        if busy < self._stall_warn:
            if timings or links:
                return progress.model_copy(update={"timings": timings, "links": links})
            return progress
        stack = stacks.thread_stack(self._user_thread)
        return progress.model_copy(
            update={
                "timings": timings,
                "links": links,
                "busy_s": round(busy, 1),
                "busy_at": stacks.place(stack)[:256],
                "busy_stack": stacks.render([("event loop thread", stack)]),
            }
        )

    async def _diagnose(self) -> Diagnosis:
        """Ask the user's loop; if it is blocked, read its thread's stack from here."""
        assert self._user_loop is not None
        try:
            live = asyncio.run_coroutine_threadsafe(self._live(), self._user_loop)
        except RuntimeError:  # the user's loop is closed
            return self._blocked()
        try:
            async with asyncio.timeout(_LIVE_WAIT):
                return await asyncio.wrap_future(live)
        except TimeoutError:
            return self._blocked()

    async def _live(self) -> Diagnosis:
        return self.diagnosis()

    def _blocked(self) -> Diagnosis:
        stack = stacks.thread_stack(self._user_thread)
        return Diagnosis(
            collectives=self._recorder.snapshot(live=False),
            where=stacks.place(stack),
            stack=stacks.render([("event loop thread (blocked)", stack)]),
        )
