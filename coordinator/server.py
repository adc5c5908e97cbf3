"""asyncio shell around :class:`Rendezvous`: moves bytes, runs the liveness clock.

Each connection: authenticated handshake (bounded), then control messages fed to the
state machine, whose actions are written back. A malformed or hostile connection gets a
typed error and is closed; everyone else keeps being served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from shardwire.coordinator.rendezvous import (
    Action,
    Close,
    JobState,
    Rendezvous,
    RendezvousConfig,
    Send,
)
from shardwire.protocol import (
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
from shardwire.protocol.messages import (
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

log = logging.getLogger("shardwire.coordinator")

# Control frames are small; this keeps a hostile client from making the coordinator hold
# more than 64 KiB per connection.
_CONTROL_LIMITS = Limits(max_payload=0)
_READ_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    rendezvous: RendezvousConfig
    handshake_timeout: float = 10.0
    tick_interval: float = 0.2
    idle_timeout: float = 60.0


class _Conn:
    """One client's stream plus its frame decoder."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(limits=_CONTROL_LIMITS)
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

    def send(self, msg: Message) -> None:
        if not self.writer.is_closing():
            self.writer.write(message_bytes(msg))


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
        self.address: tuple[str, int] = ("", 0)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._on_connect, host, port)
        self.address = self._server.sockets[0].getsockname()[:2]
        self._ticker = asyncio.create_task(self._tick_loop(), name="coordinator-ticker")
        return self.address

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in (self._ticker, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in self._conns.values():
            conn.writer.close()
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.tick_interval)
            self._apply(self.rendezvous.tick(self._clock()))

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            conn = self._conns.get(action.conn)  # type: ignore[call-overload]
            if conn is None:
                continue
            match action:
                case Send(msg=msg):
                    conn.send(msg)
                case Close():
                    conn.writer.close()
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
            log.warning("closing connection from %s: %s", conn.peer_host, exc)
            conn.send(Error(code="bad_request", message=str(exc)))
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.pop(conn_id, None)
            self._apply(self.rendezvous.disconnected(conn_id))
            writer.close()
            self._tasks.discard(task)

    async def _serve(self, conn_id: int, conn: _Conn) -> None:
        async with asyncio.timeout(self._config.handshake_timeout):
            hello = await self._handshake(conn)
        if hello is None:
            return
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
                log.warning("refused %s: %s", conn.peer_host, reply.message)
                await conn.writer.drain()
                return None
        return shake.hello

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
                return rdzv.report_failure(conn_id, msg)
            case Leave():
                return rdzv.leave(conn_id, msg)
            case StatusRequest():
                return [Send(conn_id, rdzv.status(now))]
        return [
            Send(conn_id, Error(code="bad_request", message=f"unexpected {msg.kind!r}")),
            Close(conn_id),
        ]
