"""asyncio shell around :class:`Rendezvous`: moves bytes, runs the liveness clock.

Each connection: authenticated handshake (bounded), then control messages fed to the
state machine, whose actions are written back. A malformed or hostile connection gets a
typed error and is closed; everyone else keeps being served.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections import deque
from dataclasses import dataclass

from shardwire.coordinator.refusals import RefusalLog
from shardwire.coordinator.rendezvous import Rendezvous
from shardwire.coordinator.state import (
    Action,
    Close,
    JobState,
    Notice,
    RendezvousConfig,
    Send,
)
from shardwire.protocol import (
    HANDSHAKE_LIMITS,
    SMALL_STAGE,
    Frame,
    FrameDecoder,
    Limits,
    ProtocolError,
    ServerHandshake,
    Token,
    VersionMismatch,
    frame_message,
    message_bytes,
)
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
    StatusRequest,
)
from shardwire.protocol.placement import PeerQuery

log = logging.getLogger("shardwire.coordinator")

# Control frames are small; this keeps a hostile client from making the coordinator hold
# more than 64 KiB per connection.
_CONTROL_LIMITS = Limits(max_payload=0)
_READ_CHUNK = 64 * 1024
_CLOSE_GRACE = 2.0  # seconds connection handlers get to end by themselves on close


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


# Sent, pre-encoded, to a connection over max_unauthenticated; its client retries.
_BUSY = message_bytes(
    Error(code="busy", message="the coordinator is busy with other handshakes; retry")
)
# Accept queue: a burst of a thousand joiners must not meet a full queue (the kernel
# caps it at net.core.somaxconn).
BACKLOG = 4096


class _Conn:
    """One client's stream plus its frame decoder."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        # Handshake limits and a small stage until the client is authenticated.
        self.decoder = FrameDecoder(limits=HANDSHAKE_LIMITS, stage_bytes=SMALL_STAGE)
        self.frames: deque[Frame] = deque()
        peer = writer.get_extra_info("peername") or ("", 0)
        self.peer_host = str(peer[0])

    async def recv(self) -> Message:
        while not self.frames:
            data = await self.reader.read(_READ_CHUNK)
            if not data:
                raise ConnectionResetError("connection closed by peer")
            self.frames.extend(self.decoder.feed(data))
        return frame_message(self.frames.popleft())

    def send(self, msg: Message, data: bytes | None = None) -> None:
        """Write ``msg`` (``data``: its encoding, when the caller has it already)."""
        if not self.writer.is_closing():
            self.writer.write(message_bytes(msg) if data is None else data)


class CoordinatorServer:
    """Serves one job's rendezvous until it finishes or fails."""

    def __init__(self, config: ServerConfig, token: Token, *, clock=time.monotonic):
        self._config = config
        self._token = token
        self._clock = clock
        self.rendezvous = Rendezvous(config.rendezvous)
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.done = asyncio.Event()
        self._closing = False
        self._unauthenticated = 0
        self._encoded: dict[int, tuple[Message, bytes]] = {}  # recent messages' encodings
        self._refusals = RefusalLog()
        self.address: tuple[str, int] = ("", 0)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        tls = self._config.tls
        self._server = await asyncio.start_server(
            self._on_connect,
            host,
            port,
            ssl=tls,
            ssl_handshake_timeout=self._config.handshake_timeout if tls else None,
            backlog=BACKLOG,
        )
        self.address = self._server.sockets[0].getsockname()[:2]
        self._ticker = asyncio.create_task(self._tick_loop(), name="coordinator-ticker")
        return self.address

    async def aclose(self) -> None:
        """Stop listening, end every connection and the ticker; re-raise a ticker error.

        Connections are closed first, so their handlers see end-of-stream and return
        on their own; only a handler that does not within the grace period is cancelled.
        """
        self._closing = True
        if self._server is not None:
            self._server.close()
        for conn in self._conns.values():
            conn.writer.close()
        handlers = list(self._tasks)
        if handlers:
            _done, late = await asyncio.wait(handlers, timeout=_CLOSE_GRACE)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        self._conns.clear()
        ticker_error: BaseException | None = None
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the ticker died: the owner must hear of it
                ticker_error = exc
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
                self._apply(self.rendezvous.tick(self._clock()))
        finally:  # it only ends by cancellation or an error; aclose() re-raises the error
            self.done.set()

    def _apply(self, actions: list[Action]) -> None:
        encoded = self._encoded  # one message sent to many (an abort, a page) encoded once
        if len(encoded) > 64:
            encoded.clear()
        for action in actions:
            match action:
                case Notice(text=text):
                    log.info("%s", text)
                case Send(conn=conn_id, msg=msg) if conn_id in self._conns:
                    if isinstance(msg, Error):
                        self._refused(self._conns[conn_id].peer_host, msg.code, msg.message)
                    known = encoded.get(id(msg))
                    if known is None or known[0] is not msg:  # held: its id is not reused
                        known = encoded[id(msg)] = (msg, message_bytes(msg))
                    self._conns[conn_id].send(msg, known[1])
                case Close(conn=conn_id) if conn_id in self._conns:
                    self._conns[conn_id].writer.close()
        if self.rendezvous.state in (JobState.FINISHED, JobState.FAILED):
            self.done.set()

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # owned: cancelled and awaited by aclose()
        conn_id = next(self._ids)
        conn = _Conn(reader, writer)
        try:
            await self._serve(conn_id, conn)
        except VersionMismatch as exc:
            conn.send(Error(code="version", message=str(exc)))
        except ProtocolError as exc:
            self._refused(conn.peer_host, "bad_request", str(exc))
            conn.send(Error(code="bad_request", message=str(exc)))
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Cancelled by aclose() only. asyncio's start_server callback (3.11) reports a
            # cancelled handler as an unhandled error, so the handler ends normally here.
            if not self._closing:
                raise
        finally:
            self._conns.pop(conn_id, None)
            self._apply(self.rendezvous.disconnected(conn_id))
            writer.close()
            self._tasks.discard(task)

    async def _serve(self, conn_id: int, conn: _Conn) -> None:
        if self._unauthenticated >= self._config.max_unauthenticated:
            # over the limit: told so and closed on arrival, before any buffer is filled;
            # a worker retries (a burst of joiners is normal, not an attack)
            conn.writer.write(_BUSY)
            return
        self._unauthenticated += 1
        try:
            async with asyncio.timeout(self._config.handshake_timeout):
                hello = await self._handshake(conn)
        finally:
            self._unauthenticated -= 1
        if hello is None:
            return
        conn.decoder.upgrade(_CONTROL_LIMITS, stage_bytes=SMALL_STAGE)  # grows on demand
        self._conns[conn_id] = conn
        while not conn.writer.is_closing():
            async with asyncio.timeout(self._config.idle_timeout):
                msg = await conn.recv()
            self._apply(self._dispatch(conn_id, conn, msg))

    async def _handshake(self, conn: _Conn) -> Hello | None:
        shake = ServerHandshake(self._token, accept=self._accept)
        while not shake.done:
            reply = shake.receive(await conn.recv())
            conn.send(reply)
            if isinstance(reply, Error):
                self._refused(conn.peer_host, reply.code, reply.message)
                await conn.writer.drain()
                return None
        return shake.hello

    def _refused(self, peer: str, code: str, message: str) -> None:
        line = self._refusals.line(peer, code, message, self._clock())
        if line is not None:
            log.warning("%s", line)

    def _accept(self, hello: Hello) -> Error | None:
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

    def _dispatch(self, conn_id: int, conn: _Conn, msg: Message) -> list[Action]:
        now = self._clock()
        rdzv = self.rendezvous
        match msg:
            case Join():
                return rdzv.join(conn_id, msg, peer_host=conn.peer_host, now=now)
            case NodeJoin():
                return rdzv.node_join(conn_id, msg, now)
            case Heartbeat():
                return rdzv.heartbeat(conn_id, msg, now)
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
