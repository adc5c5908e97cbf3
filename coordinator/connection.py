"""One client connection of the coordinator: an asyncio protocol, no task per connection.

Bytes in become events in the sans-IO :class:`~shardwire.protocol.channel.Channel`,
which answers the handshake itself (with the pure
:class:`~shardwire.protocol.ServerHandshake`); once the client is authenticated its
messages go to the server (``Host.received``), which feeds the rendezvous state machine
and writes its answers back through :meth:`ControlConnection.send`. Everything happens
in the event loop's callbacks as bytes arrive: a heartbeat costs one read, one parse and one
dispatch, with no task to wake. Two timers bound what a client may hold: the handshake
deadline, and the idle limit (a connection quiet for that long is closed, unless the
server says its liveness is watched otherwise, as a running worker whose heartbeats its
node agent carries). The idle timer is re-armed lazily: a message only stamps the time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, cast

from shardwire.protocol import (
    Frame,
    Limits,
    ProtocolError,
    ServerHandshake,
    Token,
    VersionMismatch,
    message_bytes,
)
from shardwire.protocol.channel import Authenticated, Channel, HandshakeRefused
from shardwire.protocol.messages import Error, Hello, Message

log = logging.getLogger("shardwire.coordinator")

# Control frames are small; this keeps a hostile client from making the coordinator hold
# more than 64 KiB per connection.
_CONTROL_LIMITS = Limits(max_payload=0)


class Host(Protocol):
    """What a connection needs of its server."""

    def hello(self, hello: Hello) -> Error | None: ...
    def admit(self, conn: ControlConnection) -> int | None: ...  # None: over the cap
    def authenticated(self, conn: ControlConnection) -> None: ...
    def received(self, conn: ControlConnection, msg: Message) -> None: ...
    def refused(self, peer: str, code: str, message: str) -> None: ...
    def watched(self, conn: ControlConnection) -> bool: ...
    def lost(self, conn: ControlConnection, authenticated: bool) -> None: ...


class ControlConnection(asyncio.Protocol):
    """A client's connection: handshake, then control messages to the server."""

    def __init__(
        self,
        host: Host,
        token: Token,
        *,
        handshake_timeout: float,
        idle_timeout: float,
        epoch: int = 0,
    ):
        self._host = host
        self._idle = idle_timeout
        self._handshake_timeout = handshake_timeout
        # the stage grows on demand, up to a control frame
        shake = ServerHandshake(token, accept=host.hello, epoch=epoch)
        self._session = Channel(shake, limits=_CONTROL_LIMITS)
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._admitted = False  # counted by the server (lost() must tell it)
        self.id = 0
        self.peer_host = ""
        self.ready = False  # authenticated

    # ---- asyncio's side -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = transport.get_extra_info("peername") or ("", 0)
        self.peer_host = self._session.peer = str(peer[0])
        conn_id = self._host.admit(self)
        if conn_id is None:  # over the cap: told so and closed, before any buffer fills
            self._transport.write(_BUSY)
            self._transport.close()
            return
        self.id, self._admitted = conn_id, True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._handshake_timeout, self.close)

    def data_received(self, data: bytes) -> None:
        try:
            for event in self._session.receive_data(data):
                if self._transport is None or self._transport.is_closing():
                    return
                if isinstance(event, Authenticated):
                    self._authenticated()
                elif isinstance(event, Frame):  # control frames carry no payload
                    raise ProtocolError("this connection does not accept data frames")
                else:
                    self._last = asyncio.get_running_loop().time()
                    self._host.received(self, event)
            self._flush()
        except HandshakeRefused as exc:
            self._flush()
            self._host.refused(self.peer_host, exc.reply.code, exc.reply.message)
            self.close()
        except VersionMismatch as exc:
            self.send(Error(code="version", message=str(exc)))
            self.close()
        except ProtocolError as exc:
            self._host.refused(self.peer_host, "bad_request", str(exc))
            self.send(Error(code="bad_request", message=str(exc)))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._admitted:
            self._admitted = False
            self._host.lost(self, self.ready)

    # ---- the server's side ----------------------------------------------------------

    def send(self, msg: Message, data: bytes | None = None) -> None:
        """Write ``msg`` (``data``: its encoding, when the caller has it already)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(message_bytes(msg) if data is None else data)

    def close(self) -> None:
        """Close once what was written is sent."""
        if self._transport is not None:
            self._transport.close()

    # ---- inside -----------------------------------------------------------------------

    def _flush(self) -> None:
        """Write the session's handshake replies."""
        data = self._session.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _authenticated(self) -> None:
        self._flush()  # the welcome before anything the server answers
        self.ready = True
        assert self._timer is not None
        self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._timer = loop.call_at(self._last + self._idle, self._idle_check)
        self._host.authenticated(self)

    def _idle_check(self) -> None:
        loop = asyncio.get_running_loop()
        due = self._last + self._idle
        if loop.time() < due or self._host.watched(self):
            self._timer = loop.call_at(max(due, loop.time() + self._idle / 2), self._idle_check)
            return
        self._timer = None
        self.close()


# Sent, pre-encoded, to a connection over the handshake cap; its client retries.
_BUSY = message_bytes(
    Error(code="busy", message="the coordinator is busy with other handshakes; retry")
)
