"""The worker's (or node agent's) control connection to the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from shardwire.protocol import JobAborted, RendezvousError, Token
from shardwire.protocol.clock import ClockQuery
from shardwire.protocol.fields import TRACEBACK_CHARS
from shardwire.protocol.messages import (
    Abort,
    DiagnoseReply,
    DiagnoseRequest,
    Diagnosis,
    Error,
    Failure,
    Finished,
    Heartbeat,
    Join,
    Leave,
    Message,
    NodeAssignment,
    NodeJoin,
    NodeRejoin,
    Rejoin,
    Rejoined,
    Restart,
    StatusRequest,
)
from shardwire.protocol.placement import PeerQuery, Placement
from shardwire.worker.runtime.attempts import CoordinatorUnreachable
from shardwire.worker.runtime.dialer import Dialer
from shardwire.worker.runtime.notes import FORM_HINT, NOTE_EVERY, WaitNotes
from shardwire.worker.runtime.queries import Queries
from shardwire.worker.runtime.rejoin import Rejoiner, join_redialing
from shardwire.worker.transport.framing import FramedProtocol

log = logging.getLogger("shardwire.worker")
__all__ = ["ControlClient", "CoordinatorUnreachable"]


async def _no_diagnosis() -> Diagnosis:
    return Diagnosis()


class ControlClient(Queries):
    """Handshake, join, heartbeats and abort notifications over one connection.

    ``on_abort`` runs (synchronously, in the event loop) when the coordinator broadcasts
    an abort or the connection to it is lost while the job runs. ``on_diagnose`` builds
    the answer when the coordinator asks what this process is doing (a job hangs).
    ``on_generation`` hears a node agent's ``Restart`` and ``Finished``.
    ``on_coordinator`` hears True when the connection dropped mid-job and this client
    waits for the coordinator's return, False once the coordinator took it back.
    """

    def __init__(
        self,
        *,
        token: Token,
        run_id: str,
        role: str,
        on_abort: Callable[[Abort | None], None] = lambda _msg: None,
        on_diagnose: Callable[[], Awaitable[Diagnosis]] = _no_diagnosis,
        on_generation: Callable[[Restart | Finished], None] = lambda _msg: None,
        on_coordinator: Callable[[bool], None] = lambda _away: None,
        tls: ssl.SSLContext | None = None,
        generation: int = 0,
    ):
        self._role = role
        self._on_coordinator = on_coordinator
        self._on_abort = on_abort
        self._on_diagnose = on_diagnose
        self._on_generation = on_generation
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._proto: FramedProtocol | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._replies: set[asyncio.Task[None]] = set()  # diagnosis answers in flight
        self._leaving = False
        self._asking = asyncio.Lock()  # one request at a time: replies match by kind
        self._placed = -1  # the generation of this worker's placement
        self._joining = False  # a join in flight: it dials again if the connection drops
        self._progress = Heartbeat()
        self._compose: Callable[[Heartbeat], Heartbeat] = lambda progress: progress
        self._route: Callable[[Heartbeat], bool] | None = None  # heartbeats via the agent
        self._interval = 0.0  # between heartbeats, once started
        self._final: Message | None = None  # a last message written while it was away
        self._dialer = Dialer(
            token=token,
            role=role,
            run_id=run_id,
            generation=generation,
            tls=tls,
            on_message=self._received,
            opened=self._opened,
            dialed=self._dialed,
        )
        self._rejoiner = Rejoiner(
            where=lambda: self._dialer.where,
            role=role,
            dial=self._redial,
            rejoin=self._send_rejoin,
            back=self._returned,
            lost=self._gave_up,
            away=lambda: self._on_coordinator(True),
        )

    async def connect(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        note_every: float = NOTE_EVERY,
        replicas: Sequence[tuple[str, int]] = (),
    ) -> None:
        """Connect and authenticate (see :meth:`Dialer.reach`); ``replicas``: the
        addresses of the coordinator's other replicas (etcd), each dialed in turn."""
        self._dialer.addresses = [(host, port), *(a for a in replicas if a != (host, port))]
        await self._dialer.reach(timeout, note_every)

    @property
    def where(self) -> str:
        """The address of the coordinator (of its replicas, the one that answered last)."""
        return self._dialer.where

    def _opened(self, proto: FramedProtocol | None) -> None:
        self._proto = proto

    def _dialed(self, proto: FramedProtocol) -> None:
        proto.closed.add_done_callback(self._lost)  # from now on a close is the job's end

    def _received(self, msg: Message) -> None:
        if isinstance(msg, DiagnoseRequest):
            task = asyncio.create_task(self._answer(), name="shardwire-diagnosis")
            self._replies.add(task)
            task.add_done_callback(self._replies.discard)
            return
        if isinstance(msg, Abort | Finished):  # the end: a closing connection is no news
            self._rejoiner.grace = 0.0
        if isinstance(msg, Abort):
            self._on_abort(msg)
        if isinstance(msg, Restart | Finished):
            self._on_generation(msg)
            return
        self._inbox.put_nowait(msg)

    async def _answer(self) -> None:
        diagnosis = await self._on_diagnose()
        if self._proto is not None:
            self._proto.write_message(DiagnoseReply(diagnosis=diagnosis))

    def _lost(self, fut: asyncio.Future) -> None:
        if self._proto is not None and fut is not self._proto.closed:
            return  # a connection before the current one
        if (self._leaving and self._final is None) or self._joining:
            return  # leaving; or joining, which dials again itself
        if not self._rejoiner.start() and not self._leaving:  # no grace: the job ends now
            self._on_abort(None)

    async def _redial(self) -> None:
        await self._dialer.dial_any()

    async def _send_rejoin(self, msg: Rejoin | NodeRejoin, timeout: float) -> None:
        await self._ask(msg, Rejoined, timeout)

    def _returned(self) -> None:
        """Reconnected: heartbeats resume; a last message written meanwhile goes out."""
        self._on_coordinator(False)
        if self._interval and (self._heartbeat is None or self._heartbeat.done()):
            self._heartbeat = asyncio.create_task(
                self._beat(self._interval), name="shardwire-heartbeat"
            )
        if self._final is not None and self._proto is not None:
            self._proto.write_message(self._final)
            self._final = None  # delivered: the connection's end is no more news

    def _gave_up(self, why: str) -> None:
        log.error("%s: %s", self._role, why)
        if not self._leaving:
            self._on_abort(None)

    def _write_final(self, msg: Message) -> None:
        """This process's last word (Leave, Failure): kept for the coordinator's return
        when it is away."""
        if self._rejoiner.away:
            self._final = msg
        elif self._proto is not None:
            self._proto.write_message(msg)

    async def _request(
        self,
        msg: Join | NodeJoin | StatusRequest | PeerQuery | ClockQuery,
        expect: type,
        timeout: float,
    ):
        for _ in range(2):  # once more if the coordinator went away and came back
            await self._rejoiner.wait_returned(timeout)
            try:
                async with self._asking:
                    return await self._ask(msg, expect, timeout)
            except JobAborted:
                if not self._rejoiner.away:
                    raise
        raise JobAborted(f"the coordinator at {self.where} went away twice during one request")

    async def _ask(self, msg: Message, expect: type, timeout: float):
        assert self._proto is not None
        self._proto.write_message(msg)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    reply = await self._next()
                    if isinstance(reply, expect):
                        return reply
                    if isinstance(reply, Error):
                        raise RendezvousError(reply.message, code=reply.code)
        except TimeoutError:
            raise RendezvousError(
                f"the coordinator sent no {expect.__name__.lower()} within {timeout:g} s",
                code="join_timeout",
            ) from None

    async def _next(self) -> Message:
        assert self._proto is not None
        get: asyncio.Future[Any] = asyncio.ensure_future(self._inbox.get())
        closed: asyncio.Future[Any] = self._proto.closed
        try:
            await asyncio.wait([get, closed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            get.cancel()
        if get.done() and not get.cancelled():
            return get.result()
        raise JobAborted("the coordinator closed the connection")

    async def join(self, msg: Join, *, timeout: float, note_every: float = NOTE_EVERY) -> Placement:
        """Join and wait for this worker's placement (bounded by ``timeout``; said every
        ``note_every`` seconds while the job forms)."""
        what = f"world size {msg.world_size}"
        place: Placement = await self._forming(msg, Placement, what, timeout, note_every)
        self._placed = place.generation
        self._rejoiner.grace = place.grace
        self._rejoiner.message = Rejoin(rank=place.rank, generation=place.generation, join=msg)
        return place

    async def node_join(
        self, msg: NodeJoin, *, timeout: float, note_every: float = NOTE_EVERY
    ) -> NodeAssignment:
        """Join as a node agent and wait for the node rank (said every ``note_every``
        seconds while the job's nodes gather)."""
        what = f"{msg.local_world_size} ranks on this node"
        got = await self._forming(msg, NodeAssignment, what, timeout, note_every)
        self._rejoiner.grace = got.grace
        self._rejoiner.message = NodeRejoin(
            node_rank=got.node_rank, generation=got.generation, join=msg
        )
        return got

    async def _forming(
        self, msg: Join | NodeJoin, expect: type, what: str, timeout: float, note_every: float
    ) -> Any:
        """Ask to join and wait for the answer, dialing a lost coordinator again."""
        waiting = f"{self._role}: waiting for the job to form at {self.where}"
        tries = WaitNotes(waiting, timeout, hint=FORM_HINT, last=f"joined, {what}")
        self._joining = True
        try:
            return await join_redialing(
                lambda left: tries.around(self._request(msg, expect, left), note_every),
                lost=lambda: self._proto is not None and self._proto.closed.done(),
                redial=lambda left: self._dialer.reach(left, NOTE_EVERY),
                timeout=timeout,
                who=f"{self._role}: the coordinator at {self.where}",
            )
        finally:
            self._joining = False

    def set_progress(self, progress: Heartbeat) -> None:
        """Report progress now and in every later heartbeat (status pages, metrics)."""
        self._progress = progress
        self._send_beat(progress)

    def relay(self, route: Callable[[Heartbeat], bool] | None) -> None:
        """Send heartbeats through ``route`` (a :class:`~shardwire.worker.runtime.beats.
        BeatRelay` to the node agent) from now on; one it does not take goes directly."""
        self._route = route

    def send(self, msg: Message) -> None:
        """Write ``msg`` to the coordinator (a node agent's node beats)."""
        if self._proto is not None:
            self._proto.write_message(msg)

    def _send_beat(self, beat: Heartbeat) -> None:
        if (self._route is None or not self._route(beat)) and self._proto is not None:
            self._proto.write_message(beat)

    def start_heartbeats(
        self,
        interval: float,
        *,
        compose: Callable[[Heartbeat], Heartbeat] = lambda progress: progress,
    ) -> None:
        """Send a heartbeat every ``interval`` seconds; ``compose`` adds to the progress."""
        self._compose = compose
        self._interval = interval
        self._heartbeat = asyncio.create_task(self._beat(interval), name="shardwire-heartbeat")

    async def _beat(self, interval: float) -> None:
        assert self._proto is not None
        while self._proto.is_open:
            self.beat()
            await asyncio.sleep(interval)

    def beat(self, *, direct: bool = False) -> None:
        """Send a heartbeat now (besides the periodic ones); ``direct``: to the
        coordinator even where the node agent carries them (news that must not wait for
        the agent's next node beat, or arrive after this worker's next message)."""
        beat = self._compose(self._progress)
        if direct and self._proto is not None:
            self._proto.write_message(beat)
        else:
            self._send_beat(beat)

    def _last_beat(self) -> None:
        """Before the last message: the latest progress, directly (a relayed beat may lag)."""
        if self._route is not None:
            self.beat(direct=True)

    def report_failure(
        self, reason: str, traceback: str, *, code: str = "", diagnosis: Diagnosis | None = None
    ) -> None:
        """Tell the coordinator this process raised (it aborts the job with this)."""
        self._leaving = True
        self._last_beat()
        tail = traceback[-TRACEBACK_CHARS:]
        failure = Failure(reason=reason[:4096], traceback=tail, code=code, diagnosis=diagnosis)
        self._write_final(failure)

    def report_peer_failure(self, rank: int, reason: str) -> None:
        """Tell the coordinator that the connection to peer ``rank`` died."""
        if self._proto is not None:
            self._proto.write_message(Failure(rank=rank, reason=reason[:4096]))

    def leave(self) -> None:
        self._leaving = True
        self._last_beat()
        self._write_final(Leave())

    async def away_and_back(self, timeout: float) -> None:
        """Until the coordinator went away and this client took it back (bounded)."""
        await self._rejoiner.away_and_back(timeout)

    def closing_bound(self) -> float:
        """Seconds :meth:`aclose` may wait for the coordinator's return, to deliver this
        process's last word (0 unless it is away with one pending)."""
        return self._rejoiner.remaining() if self._final is not None else 0.0

    async def aclose(self) -> None:
        """Stop heartbeats and pending answers, then close (bounded), whatever happens."""
        if self._final is not None:  # this process's last word: wait (bounded) to deliver it
            await self._rejoiner.wait_returned(self._rejoiner.remaining())
        self._leaving = True
        await self._rejoiner.aclose()
        tasks = [t for t in (self._heartbeat, *self._replies) if t is not None]
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if self._proto is not None:
            self._proto.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self._proto.closed)
        for result in results:
            if isinstance(result, Exception):
                raise result
