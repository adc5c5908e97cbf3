"""The worker's (or node agent's) control connection to the coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shardwire.protocol import (
    ClientHandshake,
    JobAborted,
    Limits,
    RendezvousError,
    ShardwireError,
    Token,
)
from shardwire.protocol.clock import ClockQuery, ClockReply
from shardwire.protocol.clock import offset as estimate_offset
from shardwire.protocol.fields import TRACEBACK_CHARS
from shardwire.protocol.messages import (
    STATUS_PAGE,
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
    Restart,
    StatusReply,
    StatusRequest,
)
from shardwire.protocol.placement import PEER_PAGE, Member, PeerPage, PeerQuery, Placement
from shardwire.worker.runtime.notes import FORM_HINT, NOTE_EVERY, WaitNotes
from shardwire.worker.transport.framing import FramedProtocol, open_connection

_CONTROL_LIMITS = Limits(max_payload=0)


class CoordinatorUnreachable(ShardwireError):
    """No coordinator answered at the given address in time."""


async def _no_diagnosis() -> Diagnosis:
    return Diagnosis()


# Failures of one attempt that a coordinator still starting explains: retried.
_NOT_YET = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


def _not_yet(exc: OSError) -> str | None:
    """Why an attempt failed, if trying again later may succeed; None if not."""
    if isinstance(exc, socket.gaierror):
        return f"the name did not resolve ({exc.strerror})"
    if exc.errno in _NOT_YET:  # the stock loop's strerror is "Connect call failed (...)"
        return os.strerror(exc.errno)
    return None


class ControlClient:
    """Handshake, join, heartbeats and abort notifications over one connection.

    ``on_abort`` runs (synchronously, in the event loop) when the coordinator broadcasts
    an abort or the connection to it is lost while the job runs. ``on_diagnose`` builds
    the answer when the coordinator asks what this process is doing (a job hangs).
    ``on_generation`` hears a node agent's ``Restart`` and ``Finished``.
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
        tls: ssl.SSLContext | None = None,
        generation: int = 0,
    ):
        self._token = token
        self._generation = generation
        self._tls = tls
        self._run_id = run_id
        self._role = role
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
        self._progress = Heartbeat()
        self._compose: Callable[[Heartbeat], Heartbeat] = lambda progress: progress
        self._route: Callable[[Heartbeat], bool] | None = None  # heartbeats via the agent
        self._where = "?"  # the coordinator's address, once connect() is called

    async def connect(
        self, host: str, port: int, *, timeout: float, note_every: float = NOTE_EVERY
    ) -> None:
        """Connect and authenticate; until ``timeout``, retries a name that does not
        resolve yet and refused or unroutable connections (the coordinator, or its
        host's DNS record, may still be starting: a scheduler starts every task at
        once) and "busy" refusals (a burst of joiners), with jittered backoff. While it
        waits, a line every ``note_every`` seconds says for what."""
        self._where = f"{host}:{port}"
        tries = WaitNotes(f"{self._role}: waiting for the coordinator at {host}:{port}", timeout)
        try:
            await tries.around(self._attempts(host, port, timeout, tries), note_every)
        except TimeoutError:
            raise CoordinatorUnreachable(
                f"no coordinator answered at {host}:{port} within {timeout:g} s "
                f"(last attempt: {tries.last})"
            ) from None
        except ssl.SSLError as exc:
            raise CoordinatorUnreachable(
                f"TLS handshake with the coordinator at {host}:{port} failed "
                f"({exc.reason or exc}); check --tls-cert/--tls-key/--tls-ca "
                f"(SHARDWIRE_TLS_*) on both sides"
            ) from None
        except ConnectionError:
            hint = "; if it uses TLS, set SHARDWIRE_TLS_CERT/KEY/CA" if self._tls is None else ""
            raise CoordinatorUnreachable(
                f"the coordinator at {host}:{port} closed the connection during the handshake{hint}"
            ) from None

    async def _attempts(self, host: str, port: int, timeout: float, tries: WaitNotes) -> None:
        """Dial until one attempt succeeds or ``timeout`` passes (TimeoutError)."""
        delay = 0.05
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await self._dial(host, port)
                    return
                except RendezvousError as exc:
                    if exc.code != "busy":
                        raise
                    tries.last = "the coordinator was busy"
                except OSError as exc:
                    if (why := _not_yet(exc)) is None:
                        raise
                    tries.last = why
                await asyncio.sleep(delay * (0.5 + random.random()))  # spread the retries
                delay = min(delay * 2, 1.0)

    async def _dial(self, host: str, port: int) -> FramedProtocol:
        """One attempt: connect and run the handshake (a fresh one: new nonce)."""
        shake = ClientHandshake(
            self._token, role=self._role, run_id=self._run_id, generation=self._generation
        )
        proto = await open_connection(
            lambda: FramedProtocol(shake, limits=_CONTROL_LIMITS, on_message=self._received),
            host,
            port,
            ssl=self._tls,
        )
        self._proto = proto
        try:
            await proto.ready
        except RendezvousError as exc:
            if exc.code == "busy":
                self._proto = None
                proto.close()
            raise
        proto.closed.add_done_callback(self._lost)  # from now on a close is the job's end
        return proto

    def _received(self, msg: Message) -> None:
        if isinstance(msg, DiagnoseRequest):
            task = asyncio.create_task(self._answer(), name="shardwire-diagnosis")
            self._replies.add(task)
            task.add_done_callback(self._replies.discard)
            return
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

    def _lost(self, _fut: asyncio.Future) -> None:
        if not self._leaving:
            self._on_abort(None)

    async def _request(
        self,
        msg: Join | NodeJoin | StatusRequest | PeerQuery | ClockQuery,
        expect: type,
        timeout: float,
    ):
        async with self._asking:
            return await self._ask(msg, expect, timeout)

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
        tries = self._forming(f"world size {msg.world_size}", timeout)
        place: Placement = await tries.around(self._request(msg, Placement, timeout), note_every)
        self._placed = place.generation
        return place

    async def peers(self, ranks: list[int], *, timeout: float) -> list[Member]:
        """The members with ``ranks`` (of this worker's generation), asked in queries of
        at most ``PEER_PAGE`` ranks, each bounded by ``timeout``."""
        members: list[Member] = []
        for start in range(0, len(ranks), PEER_PAGE):
            asked = ranks[start : start + PEER_PAGE]
            page = await self._request(PeerQuery(ranks=asked), PeerPage, timeout)
            if page.generation != self._placed or [m.rank for m in page.members] != asked:
                raise RendezvousError(
                    f"the coordinator answered ranks {[m.rank for m in page.members][:8]} of "
                    f"generation {page.generation} to a query for ranks {asked[:8]} of "
                    f"generation {self._placed}",
                    code="stale_generation",
                )
            members += page.members
        return members

    async def clock_offset(self, *, probes: int, timeout: float) -> tuple[float, float]:
        """What to add to this process's ``time.monotonic()`` to read the coordinator's
        clock, and the error bound (see ``protocol/clock.py``); each probe bounded."""
        seen = []
        for _ in range(probes):
            sent = time.monotonic()
            reply = await self._request(ClockQuery(sent=sent), ClockReply, timeout)
            seen.append((sent, reply.now, time.monotonic()))
        return estimate_offset(seen)

    async def node_join(
        self, msg: NodeJoin, *, timeout: float, note_every: float = NOTE_EVERY
    ) -> NodeAssignment:
        """Join as a node agent and wait for the node rank (said every ``note_every``
        seconds while the job's nodes gather)."""
        tries = self._forming(f"{msg.local_world_size} ranks on this node", timeout)
        return await tries.around(self._request(msg, NodeAssignment, timeout), note_every)

    def _forming(self, what: str, timeout: float) -> WaitNotes:
        waiting = f"{self._role}: waiting for the job to form at {self._where}"
        return WaitNotes(waiting, timeout, hint=FORM_HINT, last=f"joined, {what}")

    async def status(self, *, timeout: float) -> StatusReply:
        """Ask the coordinator for the job state (role "client" connections), page by
        page: every rank's row, each reply inside a control frame at any job size."""
        reply = await self._request(StatusRequest(), StatusReply, timeout)
        ranks = list(reply.ranks)
        for _ in range(reply.total // STATUS_PAGE + 1):  # bounded: the rows announced
            if len(ranks) >= reply.total:
                break
            page = await self._request(StatusRequest(offset=len(ranks)), StatusReply, timeout)
            if not page.ranks:  # the job shrank meanwhile
                break
            ranks += page.ranks
        return reply.model_copy(update={"ranks": ranks, "total": len(ranks)})

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
        if self._route is not None and self._route(beat):
            return
        if self._proto is not None:
            self._proto.write_message(beat)

    def start_heartbeats(
        self,
        interval: float,
        *,
        compose: Callable[[Heartbeat], Heartbeat] = lambda progress: progress,
    ) -> None:
        """Send a heartbeat every ``interval`` seconds; ``compose`` adds to the progress."""
        self._compose = compose
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
        """Before this worker's last message: its latest progress, directly, so that it
        arrives first (relayed beats could come after it)."""
        if self._route is not None:
            self.beat(direct=True)

    def report_failure(
        self, reason: str, traceback: str, *, code: str = "", diagnosis: Diagnosis | None = None
    ) -> None:
        """Tell the coordinator this process raised (it aborts the job with this)."""
        self._leaving = True
        self._last_beat()
        if self._proto is not None:
            self._proto.write_message(
                Failure(
                    reason=reason[:4096],
                    traceback=traceback[-TRACEBACK_CHARS:],
                    code=code,
                    diagnosis=diagnosis,
                )
            )

    def report_peer_failure(self, rank: int, reason: str) -> None:
        """Tell the coordinator that the connection to peer ``rank`` died."""
        if self._proto is not None:
            self._proto.write_message(Failure(rank=rank, reason=reason[:4096]))

    def leave(self) -> None:
        self._leaving = True
        self._last_beat()
        if self._proto is not None:
            self._proto.write_message(Leave())

    async def aclose(self) -> None:
        """Stop heartbeats and pending answers, then close (bounded), whatever happens."""
        self._leaving = True
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
