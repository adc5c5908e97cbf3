"""Heartbeats batched per node: the worker's end (:class:`BeatRelay`) and the node
agent's end (:class:`NodeBeats`) of the agent's local socket.

Theory of operation: a coordinator of 10,000 workers would otherwise read 10,000
heartbeats a second. Where a node agent runs, it listens on a Unix socket in a fresh
directory only its user can enter (``SHARDWIRE_AGENT_BEATS`` tells its workers where).
A worker, once placed, writes each heartbeat there as a ``RankBeat``; every interval the
agent sends the beats it received since its last message as ``NodeBeat`` messages (one
a second per node, more only when the beats outgrow a control frame; an empty one keeps
its connection alive). Nothing here may kill a healthy job: a worker whose agent cannot
be reached, is gone, or does not read its socket sends its heartbeats to the
coordinator directly again, and the coordinator takes both kinds alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections import deque
from collections.abc import Callable
from typing import cast

from shardwire.protocol import (
    SMALL_STAGE,
    FrameDecoder,
    InvalidState,
    Limits,
    ProtocolError,
    frame_message,
)
from shardwire.protocol.beats import Heartbeat, NodeBeat, RankBeat, pack_beats
from shardwire.protocol.control import message_bytes
from shardwire.worker.runtime.scratch import Scratch

log = logging.getLogger("shardwire.worker")

_LIMITS = Limits(max_payload=0)
_BACKLOG = 1 << 20  # bytes a relay leaves unread by its agent before it beats directly
_PENDING = 1 << 16  # beats an agent holds at most between two node beats (oldest dropped)
_PREFIX, _SOCKET = "shardwire-beats-", "beats.sock"
_SUN_PATH = 107  # bytes a Unix socket's path may have (Linux's sun_path, less its NUL)


def socket_parent() -> str:
    """Where the socket's directory goes: the temporary directory (``TMPDIR``), unless a
    socket's path there would pass the 107 bytes it may have; then ``/tmp``."""
    tail = len(f"/{_PREFIX}XXXXXXXX/{_SOCKET}")  # mkdtemp adds 8 characters
    given = tempfile.gettempdir()
    for parent in (given, "/tmp"):
        if len(os.fsencode(parent)) + tail <= _SUN_PATH and os.access(parent, os.W_OK | os.X_OK):
            return parent
    raise InvalidState(
        f"no directory for the node agent's heartbeat socket: a socket's path may have "
        f"{_SUN_PATH} bytes, the temporary directory {given!r} is {len(os.fsencode(given))} "
        "(set TMPDIR shorter) and /tmp cannot be written"
    )


class _Link(asyncio.Protocol):
    """One end of the local socket: counts what the other end reads, drops what it sends."""

    def __init__(self, on_frames: Callable[[list], None] | None = None):
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self._decoder = FrameDecoder(limits=_LIMITS, stage_bytes=SMALL_STAGE)
        self._on_frames = on_frames

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def data_received(self, data: bytes) -> None:
        if self._on_frames is None or self.transport is None:
            return
        try:
            self._on_frames([frame_message(f) for f in self._decoder.feed(data)])
        except ProtocolError as exc:
            log.warning("heartbeat socket: %s; closing that connection", exc)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class BeatRelay:
    """A placed worker's heartbeats to its node agent: call it with a heartbeat; False
    means it was not taken (send it to the coordinator instead)."""

    def __init__(self, link: _Link, rank: int, generation: int):
        self._link = link
        self._rank = rank
        self.generation = generation  # of its placement
        self._warned = False

    @classmethod
    async def open(cls, path: str, rank: int, generation: int, *, timeout: float) -> BeatRelay:
        """Connect to the agent's socket at ``path`` (bounded); raises OSError or
        TimeoutError if it cannot be reached."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            _transport, link = await loop.create_unix_connection(_Link, path)
        return cls(link, rank, generation)

    def __call__(self, beat: Heartbeat) -> bool:
        transport = self._link.transport
        usable = transport is not None and not transport.is_closing() and not self._link.lost
        if usable and transport is not None and transport.get_write_buffer_size() < _BACKLOG:
            entry = RankBeat(rank=self._rank, generation=self.generation, beat=beat)
            transport.write(message_bytes(entry))
            return True
        if not self._warned:
            self._warned = True
            why = "gone" if not usable else "not reading"
            log.warning(
                "rank %d: the node agent does not take heartbeats (%s); sending them to "
                "the coordinator directly",
                self._rank,
                why,
            )
        return False

    def close(self) -> None:
        if self._link.transport is not None:
            self._link.transport.close()


class NodeBeats:
    """The agent's end: a local socket its workers beat into, and a task that sends what
    arrived every ``interval`` seconds through ``send`` (the agent's control client)."""

    def __init__(self, send: Callable[[NodeBeat], None], interval: float):
        self._send = send
        self._interval = interval
        self._pending: deque[RankBeat] = deque(maxlen=_PENDING)
        self._dir: Scratch | None = None
        self._server: asyncio.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._links: list[_Link] = []  # its workers' connections, closed with it
        self.path = ""

    async def start(self) -> str:
        """Listen in a new directory of mode 0700 (in the temporary directory, or
        ``/tmp`` where that one's path is too long for a socket's) and start forwarding;
        returns the socket's path (for ``SHARDWIRE_AGENT_BEATS``)."""
        self._dir = Scratch(_PREFIX, socket_parent())  # mode 0700; dead agents' swept
        self.path = str(self._dir.path / _SOCKET)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, self.path)
        self._task = asyncio.create_task(self._forward(), name="shardwire-node-beats")
        return self.path

    def _accept(self) -> _Link:
        self._links = [link for link in self._links if not link.lost]
        link = _Link(self._received)
        self._links.append(link)
        return link

    def _received(self, messages: list) -> None:
        for msg in messages:
            if not isinstance(msg, RankBeat):
                raise ProtocolError(f"expected rank beats, got {msg.kind!r}")
            self._pending.append(msg)

    def flush(self) -> None:
        """Send the beats received since the last node beat (none: an empty one)."""
        beats = list(self._pending)
        self._pending.clear()
        for message in pack_beats(beats):
            self._send(message)

    async def _forward(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.flush()

    async def aclose(self) -> None:
        """Stop forwarding and listening, and remove the socket's directory."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._server is not None:
            self._server.close()
            for link in self._links:
                if link.transport is not None:
                    link.transport.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
        if self._dir is not None:
            self._dir.remove()
