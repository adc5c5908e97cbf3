"""asyncio shell around :class:`Rendezvous`: moves bytes, runs the liveness clock.

Each connection (:class:`~shardwire.coordinator.connection.ControlConnection`, an
asyncio protocol): authenticated handshake (bounded), then control messages fed to the
state machine as they arrive, whose actions are written back. A malformed or hostile
connection gets a typed error and is closed; everyone else keeps being served.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from shardwire.coordinator.connection import ControlConnection
from shardwire.coordinator.journal import Deposed, JournalStore
from shardwire.coordinator.listening import refused
from shardwire.coordinator.refusals import RefusalLog
from shardwire.coordinator.rendezvous import Rendezvous
from shardwire.coordinator.state import (
    Action,
    Close,
    JobState,
    Notice,
    Record,
    RendezvousConfig,
    Send,
)
from shardwire.protocol import Token, message_bytes
from shardwire.protocol.beats import NodeBeat
from shardwire.protocol.clock import ClockQuery, ClockReply
from shardwire.protocol.messages import (
    DiagnoseReply,
    Error,
    Failure,
    Heartbeat,
    Hello,
    Join,
    Leave,
    Message,
    NodeJoin,
    NodeRejoin,
    Rejoin,
    StatusRequest,
)
from shardwire.protocol.placement import PeerQuery

log = logging.getLogger("shardwire.coordinator")

_CLOSE_GRACE = 2.0  # seconds the listener gets to close
_WRITE_GRACE = 30.0  # seconds records still being written get when the server closes


async def _write(path: str, doc: dict) -> None:
    """Write ``doc`` as JSON to ``path`` (whole, then renamed into place), off the loop."""

    def write() -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        os.replace(tmp, target)

    try:
        await asyncio.to_thread(write)
    except OSError as exc:
        log.warning("could not write %s: %s", path, exc)
        return
    log.info("wrote %s", path)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    rendezvous: RendezvousConfig
    handshake_timeout: float = 10.0
    tick_interval: float = 0.2
    idle_timeout: float = 60.0
    # connections still in their handshake, at most (each holds a 4 KiB buffer): as many
    # as the accept queue, so a burst of joiners is served, not told to come back
    max_unauthenticated: int = 4096
    tls: ssl.SSLContext | None = None  # mutual TLS on the listener, or plain TCP
    state: JournalStore | None = None  # where the running generation is journaled, if
    epoch: int = 0  # this coordinator's leadership (etcd), said to every client it welcomes


# Accept queue: a burst of a thousand joiners must not meet a full queue (the kernel
# caps it at net.core.somaxconn).
BACKLOG = 4096


class CoordinatorServer:
    """Serves one job's rendezvous until it finishes or fails."""

    def __init__(self, config: ServerConfig, token: Token, *, clock=time.monotonic):
        self._config = config
        self._token = token
        self._clock = clock
        self.rendezvous = Rendezvous(config.rendezvous)
        self._conns: dict[int, ControlConnection] = {}  # authenticated, by id
        self._handshaking: set[ControlConnection] = set()  # the others (closed with it)
        self._ids = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.done = asyncio.Event()
        self._closing = False
        self._unauthenticated = 0
        self._encoded: dict[int, tuple[Message, bytes]] = {}  # recent messages' encodings
        self._refusals = RefusalLog()
        self._writes: set[asyncio.Task[None]] = set()  # records being written
        self.address: tuple[str, int] = ("", 0)
        self._journaled: tuple[int, JobState, bool] | None = None  # what the journal holds
        self.restored = ""  # what was taken back from a journal (said once listening)
        self.deposed = ""  # why it stopped serving, if another replica leads in its place
        if config.state is not None:  # a journal there: this coordinator was restarted
            journal = config.state.read()
            if journal is not None:
                since = max(0.0, time.time() - journal.written_at) if journal.written_at else 0.0
                self.rendezvous.restore(journal, clock(), since_written=since)
                rdzv = self.rendezvous
                self._journaled = (rdzv.generation, rdzv.state, rdzv.assigned)
                self.restored = self.rendezvous.events[-1][1]

    async def start(self, host: str, port: int) -> tuple[str, int]:
        tls = self._config.tls
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._connection,
                host,
                port,
                ssl=tls,
                ssl_handshake_timeout=self._config.handshake_timeout if tls else None,
                backlog=BACKLOG,
            )
        except OSError as exc:
            raise refused("the coordinator", host, port, exc, "--port (0: a free one)") from None
        self.address = self._server.sockets[0].getsockname()[:2]
        self._ticker = asyncio.create_task(self._tick_loop(), name="coordinator-ticker")
        return self.address

    def _connection(self) -> ControlConnection:
        cfg = self._config
        return ControlConnection(
            self,
            self._token,
            handshake_timeout=cfg.handshake_timeout,
            idle_timeout=cfg.idle_timeout,
            epoch=cfg.epoch,
        )

    def depose(self, why: str) -> None:
        """Another replica may lead now: serve nothing more, at once (the workers find
        the leader among the replicas' addresses, and keep training meanwhile)."""
        if self.deposed:
            return
        self.deposed = why
        log.warning("deposed: %s; closing every connection", why)
        self._stop_serving()
        self.done.set()

    def _stop_serving(self) -> None:
        """Stop listening and close every connection (nothing is served from now on)."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for conn in [*self._conns.values(), *self._handshaking]:
            conn.close()
        self._conns.clear()

    async def aclose(self) -> None:
        """Stop listening, close every connection and end the ticker; re-raise a ticker
        error."""
        self._stop_serving()
        ticker_error: BaseException | None = None
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the ticker died: the owner must hear of it
                ticker_error = exc
        if self._writes:  # a verdict's file must not be lost as the job ends
            _done, late = await asyncio.wait(list(self._writes), timeout=_WRITE_GRACE)
            for task in late:
                log.warning("%s not written within %g s", task.get_name(), _WRITE_GRACE)
                task.cancel()
        if self._server is not None:
            try:
                async with asyncio.timeout(_CLOSE_GRACE):
                    await self._server.wait_closed()
            except TimeoutError:
                log.warning("listener did not close within %g s", _CLOSE_GRACE)
        if ticker_error is not None:
            raise ticker_error

    async def _tick_loop(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._config.tick_interval)
                self.apply(self.rendezvous.tick(self._clock()))
        finally:  # it only ends by cancellation or an error; aclose() re-raises the error
            self.done.set()

    def apply(self, actions: list[Action]) -> None:
        """Carry out what the rendezvous core decided: log, send, close, record."""
        try:
            self._keep_journal()  # before the placements go out: what they say is kept
        except Deposed as exc:  # a decision this coordinator may no longer make: not sent
            self.depose(str(exc))
            return
        encoded = self._encoded  # one message sent to many (an abort, a page) encoded once
        if len(encoded) > 64:
            encoded.clear()
        for action in actions:
            match action:
                case Notice(text=text):
                    log.info("%s", text)
                case Send(conn=conn_id, msg=msg) if conn_id in self._conns:
                    if isinstance(msg, Error):
                        self.refused(self._conns[conn_id].peer_host, msg.code, msg.message)
                    known = encoded.get(id(msg))
                    if known is None or known[0] is not msg:  # held: its id is not reused
                        known = encoded[id(msg)] = (msg, message_bytes(msg))
                    self._conns[conn_id].send(msg, known[1])
                case Close(conn=conn_id) if conn_id in self._conns:
                    self._conns[conn_id].close()
                case Record(path=path, doc=doc):
                    task = asyncio.create_task(_write(path, doc), name="coordinator-record")
                    self._writes.add(task)  # owned: awaited (bounded) by aclose()
                    task.add_done_callback(self._writes.discard)
        if self.rendezvous.state in (JobState.FINISHED, JobState.FAILED):
            self.done.set()

    def _keep_journal(self) -> None:
        """Journal a generation that started running; remove the journal when none runs
        (a coordinator restarted then starts afresh). Written once per generation, on
        this loop: a small file, and the placements must not go out before it is down."""
        state = self._config.state
        rdzv = self.rendezvous
        key = (rdzv.generation, rdzv.state, rdzv.assigned)
        if state is None or key == self._journaled:
            return
        self._journaled = key
        try:
            journal = rdzv.journal()
            if journal is not None:
                state.write(journal.model_copy(update={"written_at": time.time()}))
            elif rdzv.state is not JobState.FAILING:  # an inquest still runs generation g
                state.remove()
        except OSError as exc:  # supervision goes on; a restart would start afresh
            log.warning("could not journal generation %d to %s: %s", key[0], state.where, exc)

    # ---- what a connection asks of its server (connection.Host) -----------------------

    def admit(self, conn: ControlConnection) -> int | None:
        """A new connection's id, or None if the handshake slots are all taken (a burst
        of joiners is normal, not an attack: a worker told "busy" retries)."""
        if self._closing or self._unauthenticated >= self._config.max_unauthenticated:
            return None
        self._unauthenticated += 1
        self._handshaking.add(conn)
        return next(self._ids)

    def authenticated(self, conn: ControlConnection) -> None:
        self._unauthenticated -= 1
        self._handshaking.discard(conn)
        self._conns[conn.id] = conn

    def received(self, conn: ControlConnection, msg: Message) -> None:
        if not self._closing:
            self.apply(self._dispatch(conn.id, conn, msg))

    def watched(self, conn: ControlConnection) -> bool:
        """Whether a quiet connection stays open: a running worker, whose heartbeats its
        node's agent may carry (its liveness is watched by those)."""
        return self.rendezvous.beating(conn.id)

    def lost(self, conn: ControlConnection, authenticated: bool) -> None:
        if not authenticated:
            self._unauthenticated -= 1
            self._handshaking.discard(conn)
            return
        self._conns.pop(conn.id, None)
        if not self._closing:
            self.apply(self.rendezvous.disconnected(conn.id))

    def refused(self, peer: str, code: str, message: str) -> None:
        line = self._refusals.line(peer, code, message, self._clock())
        if line is not None:
            log.warning("%s", line)

    def hello(self, hello: Hello) -> Error | None:
        expected = self._config.rendezvous.run_id
        if hello.run_id != expected:
            return Error(
                code="run_id",
                message=f"wrong run id: this coordinator serves {expected!r}, "
                f"the joiner asked for {hello.run_id!r}",
            )
        if hello.role == "peer":
            return Error(code="bad_request", message="peer handshakes go to workers")
        current = self.rendezvous.generation
        if hello.role == "worker" and hello.generation and hello.generation != current:
            # a process of an ended generation (fencing): it must not disturb this one
            return Error(
                code="stale_generation",
                message=f"generation {hello.generation} is over; job {expected!r} is at "
                f"generation {current}",
            )
        return None

    def _dispatch(self, conn_id: int, conn: ControlConnection, msg: Message) -> list[Action]:
        now = self._clock()
        rdzv = self.rendezvous
        match msg:
            case Join():
                return rdzv.join(conn_id, msg, peer_host=conn.peer_host, now=now)
            case NodeJoin():
                return rdzv.node_join(conn_id, msg, now)
            case Rejoin():
                return rdzv.rejoin(conn_id, msg, now)
            case NodeRejoin():
                return rdzv.node_rejoin(conn_id, msg, now)
            case Heartbeat():
                return rdzv.heartbeat(conn_id, msg, now)
            case NodeBeat():
                return rdzv.node_beat(conn_id, msg, now)
            case Failure():
                return rdzv.report_failure(conn_id, msg, now)
            case DiagnoseReply():
                return rdzv.diagnosis(conn_id, msg, now)
            case Leave():
                return rdzv.leave(conn_id, msg)
            case PeerQuery():
                return rdzv.peer_page(conn_id, msg)
            case ClockQuery(sent=sent):
                return [Send(conn_id, ClockReply(sent=sent, now=now))]
            case StatusRequest(offset=offset, limit=limit):
                return [Send(conn_id, rdzv.status(now, offset, limit))]
        return [
            Send(conn_id, Error(code="bad_request", message=f"unexpected {msg.kind!r}")),
            Close(conn_id),
        ]
