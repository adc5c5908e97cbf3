"""Hostile and faulty network peers for tests: idle, garbage and trickling connections
against a port, a loopback proxy that flips one byte of a chosen frame, and readings of
a process's memory and descriptors from /proc.

Everything here targets loopback addresses the test chose, and every connection it opens
is closed by the helper that opened it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardwire.protocol.frames import PREFIX, PREFIX_SIZE, FrameKind

_OPEN_TIMEOUT = 10.0


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (VmRSS from /proc/PID/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"no VmRSS for process {pid}")


def fd_count(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Held:
    """One held connection; ``closed`` once the server has closed it."""

    writer: asyncio.StreamWriter
    watcher: asyncio.Task[None]

    @property
    def closed(self) -> bool:
        return self.watcher.done()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(1 << 16):
            pass


@contextlib.asynccontextmanager
async def idle_connections(
    address: tuple[str, int], count: int, *, payload: bytes = b""
) -> AsyncIterator[list[Held]]:
    """Hold ``count`` connections to ``address``, each having sent ``payload`` (garbage,
    a partial frame, or nothing); all are closed on exit."""
    held: list[Held] = []
    try:
        for _ in range(count):
            try:
                async with asyncio.timeout(_OPEN_TIMEOUT):
                    reader, writer = await asyncio.open_connection(*address)
            except OSError:
                break  # the listener's backlog is full: the point is made
            held.append(Held(writer, asyncio.create_task(_until_eof(reader))))
            if payload:
                writer.write(payload)
        yield held
    finally:
        for h in held:
            h.watcher.cancel()
            h.writer.close()
        await asyncio.gather(*(h.watcher for h in held), return_exceptions=True)


def open_count(held: list[Held]) -> int:
    """How many of ``held`` the server has not closed yet."""
    return sum(not h.closed for h in held)


async def trickle(address: tuple[str, int], *, interval: float, limit: float) -> float:
    """Send one byte every ``interval`` seconds until the server closes the connection
    (returns the seconds it took) or ``limit`` seconds pass (returns ``limit``)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(_OPEN_TIMEOUT):
        reader, writer = await asyncio.open_connection(*address)
    try:
        while loop.time() - started < limit:
            writer.write(b"G")
            try:
                async with asyncio.timeout(interval):
                    if not await reader.read(4096):
                        return loop.time() - started
            except TimeoutError:
                pass
            except ConnectionError:
                return loop.time() - started
        return limit
    finally:
        writer.close()


@dataclass
class FlipProxy:
    """A loopback TCP proxy to ``target`` that flips one byte of the ``nth`` data frame
    (counted from 1 over all connections, dialer to listener) at ``offset`` of its meta
    (``part="meta"``) or payload (``part="payload"``), or at the byte right after the
    first occurrence of ``after`` in that part. Frames are parsed, not guessed. With
    ``part="stream"`` nothing is parsed (TLS): byte ``offset`` of the first connection's
    dialer-to-listener stream is flipped; with ``part="cut"`` the first connection is cut
    (both ways) after ``offset`` bytes of that stream."""

    target: tuple[str, int]
    nth: int = 1
    part: str = "payload"
    offset: int = 0
    after: bytes = b""
    flipped: int = 0
    _seen: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(_OPEN_TIMEOUT):
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        tasks = [
            asyncio.create_task(self._frames(reader, up_writer)),
            asyncio.create_task(self._bytes(up_reader, writer)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
                self._tasks.discard(task)
            writer.close()
            up_writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        passed = 0
        while data := await reader.read(1 << 16):
            if not self.flipped and passed <= self.offset < passed + len(data):
                self.flipped += 1
                if self.part == "cut":
                    writer.write(data[: self.offset - passed])
                    await writer.drain()
                    return  # _serve closes both sides
                changed = bytearray(data)
                changed[self.offset - passed] ^= 0x01
                data = bytes(changed)
            passed += len(data)
            writer.write(data)
            await writer.drain()

    async def _bytes(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.part in ("stream", "cut"):
            await self._stream(reader, writer)
            return
        while True:
            prefix = await reader.readexactly(PREFIX_SIZE)
            _magic, _version, kind, meta_len, payload_len = PREFIX.unpack(prefix)
            meta = bytearray(await reader.readexactly(meta_len))
            payload = bytearray(await reader.readexactly(payload_len))
            if kind == FrameKind.DATA:
                self._seen += 1
                if self._seen == self.nth:
                    chosen = meta if self.part == "meta" else payload
                    at = self.offset
                    if self.after:
                        at = chosen.index(self.after) + len(self.after)
                    chosen[at % len(chosen)] ^= 0x01
                    self.flipped += 1
            writer.write(prefix + meta + payload)
            await writer.drain()
