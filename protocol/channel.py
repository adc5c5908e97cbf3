"""A framed, authenticated connection without I/O: bytes in, events out; the bytes to
write come back out. The asyncio protocols of the coordinator (``coordinator.connection``)
and of the workers (``worker.transport.framing``) are thin shells around it.

Theory of operation
-------------------
A shell hands the session what the socket read, either through :meth:`Channel.get_buffer`
and :meth:`Channel.buffer_updated` (a buffered protocol: tensor payloads land straight in
the arrays the allocator names) or as a byte string (:meth:`Channel.receive_data`), then
takes events until :meth:`Channel.next_event` returns None:

* a :class:`~shardwire.protocol.frames.Frame` of kind DATA: a tensor, after the
  handshake only;
* :data:`AUTHENTICATED`, once, when the handshake completed (the decoder then applies
  the connection's own limits to every later frame);
* a control :class:`~shardwire.protocol.messages.Message`, after the handshake only.

Handshake messages never leave the session: it answers them itself and queues the reply,
which the shell writes (:meth:`Channel.data_to_send`) after every batch of events, and
before it closes on an error. A handshake the pure handshake refuses raises
:class:`HandshakeRefused` with the refusal already queued; any other violation raises
the :class:`~shardwire.protocol.errors.ProtocolError` that names it. A server may
``hold`` handshake messages (a worker that has no rank yet cannot judge a peer's); they
are answered by :meth:`Channel.release_held`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from shardwire.protocol.control import frame_message, message_bytes
from shardwire.protocol.decoder import SMALL_STAGE, Allocator, FrameDecoder, StagePool
from shardwire.protocol.errors import ProtocolError
from shardwire.protocol.frames import HANDSHAKE_LIMITS, Frame, FrameKind, Header, Limits
from shardwire.protocol.handshake import ClientHandshake, ServerHandshake
from shardwire.protocol.messages import Error, Message

Handshake = ClientHandshake | ServerHandshake


class Authenticated:
    """The event of a completed handshake (:data:`AUTHENTICATED`)."""

    def __repr__(self) -> str:
        return "AUTHENTICATED"


AUTHENTICATED = Authenticated()
Event = Frame | Message | Authenticated


class HandshakeRefused(ProtocolError):
    """The handshake refused the peer; ``reply`` (queued to send) says why."""

    def __init__(self, reply: Error, peer: str):
        super().__init__(f"refused peer at {peer}: {reply.message}")
        self.reply = reply


class Channel:
    """One connection's framing and handshake. ``limits``, ``stage_bytes`` and
    ``stages`` apply once authenticated (until then handshake limits and a small stage);
    ``allocator`` names where a data frame's payload goes; ``hold`` says whether a
    server must keep handshake messages for :meth:`release_held`; ``peer`` names the
    other end in errors."""

    def __init__(
        self,
        handshake: Handshake,
        *,
        limits: Limits,
        allocator: Allocator | None = None,
        stage_bytes: int = SMALL_STAGE,
        stages: StagePool | None = None,
        hold: Callable[[], bool] = lambda: False,
        peer: str = "",
    ):
        self.handshake = handshake
        self.peer = peer
        self.authenticated = False
        self._limits = limits
        self._stage_bytes = stage_bytes
        self._stages = stages
        self._allocator = allocator
        self._hold = hold
        self._held: deque[Message] = deque()
        self._out = bytearray()
        self.decoder = FrameDecoder(
            limits=HANDSHAKE_LIMITS, allocator=self._allocate, stage_bytes=SMALL_STAGE
        )
        if isinstance(handshake, ClientHandshake):
            self._out += message_bytes(handshake.hello)

    # ---- bytes in -------------------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Where the next received bytes go."""
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the last :meth:`get_buffer` view."""
        self.decoder.buffer_updated(nbytes)

    def resume(self, target: memoryview) -> None:
        """Supply the destination of the payload the allocator deferred (it returned
        None); its frame then comes out of :meth:`next_event`."""
        self.decoder.resume(target)

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Take a byte string (copied in) and return the events it completes."""
        view = memoryview(data).cast("B")
        events: list[Event] = []
        while view:
            view = self.decoder.fill(view)
            while (event := self.next_event()) is not None:
                events.append(event)
        return events

    def next_event(self) -> Event | None:
        """The next event, or None until more bytes (or a deferred destination) come."""
        while (frame := self.decoder.next_frame()) is not None:
            if frame.kind is FrameKind.DATA:
                if not self.authenticated:  # an empty one never met the allocator
                    raise ProtocolError("data before the handshake finished")
                return frame
            msg = frame_message(frame)
            if frame.kind is FrameKind.HANDSHAKE or isinstance(msg, Error):
                if not self.authenticated:
                    if self._answer(msg):
                        return AUTHENTICATED
                    continue
                if frame.kind is FrameKind.HANDSHAKE:
                    raise ProtocolError(f"handshake message {msg.kind!r} after authentication")
            if not self.authenticated:
                raise ProtocolError(f"{msg.kind!r} before the handshake finished")
            return msg
        return None

    def release_held(self) -> Authenticated | None:
        """Answer the handshake messages held while ``hold`` was true; AUTHENTICATED if
        that completed the handshake."""
        while self._held and not self.authenticated:
            if self._answer(self._held.popleft()):
                return AUTHENTICATED
        return None

    # ---- bytes out ------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """The bytes the session queued (handshake messages), once."""
        out = bytes(self._out)
        self._out.clear()
        return out

    # ---- inside ---------------------------------------------------------------------

    def _allocate(self, header: Header) -> memoryview | None:
        if not self.authenticated or self._allocator is None:
            raise ProtocolError("this connection does not accept data frames")
        return self._allocator(header)

    def _answer(self, msg: Message) -> bool:
        """Feed one handshake message; True once it completed the handshake."""
        if self._hold():
            if self._held:  # a client sends one message, then waits for the reply
                raise ProtocolError("more than one handshake message before the reply")
            self._held.append(msg)
            return False
        reply = self.handshake.receive(msg)
        if reply is not None:
            self._out += message_bytes(reply)
        if isinstance(reply, Error):
            raise HandshakeRefused(reply, self.peer)
        if not self.handshake.done:
            return False
        self.authenticated = True
        self.decoder.upgrade(self._limits, stage_bytes=self._stage_bytes, pool=self._stages)
        return True
