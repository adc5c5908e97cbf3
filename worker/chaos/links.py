"""Network faults injected into this rank's own transport, without root.

When a plan holds network faults for this rank, the injector puts a :class:`LinkFaults`
in front of the transport's ``send`` (on that transport object only; a job without
such faults has nothing in front of it). Each message then passes the faults that are
active for its destination: ``delay`` sleeps, ``throttle`` sleeps for the time the bytes
take at the capped rate, ``blackhole`` holds the message until the window closes.
``flip`` corrupts the next message on the wire: the first large write of its frame
(after the checksum was computed) goes out with its middle byte inverted, so the
receiver's checksum must catch it. ``reset`` acts at once, on the connection to the
peer: the kernel sends RST.

Only messages between processes go through ``send``: ranks of one node that share a
node arena move collective data through shared memory, which these faults do not touch.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from shardwire.worker.chaos.plan import Fault
from shardwire.worker.transport.base import Transport
from shardwire.worker.transport.mesh import TcpMesh

Send = Callable[..., Awaitable[None]]


class LinkFaults:
    """The active network faults of this rank, in front of its transport's ``send``."""

    def __init__(self, transport: Transport, seed: int) -> None:
        self.transport = transport
        self._send: Send = transport.send
        self._active: list[tuple[Fault, float]] = []  # (fault, monotonic end)
        self._flips: list[Fault] = []
        self._rng = random.Random(seed)
        transport.send = self.send  # type: ignore[method-assign]

    def start(self, fault: Fault) -> None:
        """``fault`` begins now."""
        if fault.kind == "reset":
            self._reset(fault.peer)
        elif fault.kind == "flip":
            self._flips.append(fault)
        else:
            self._active.append((fault, time.monotonic() + fault.for_s))

    async def send(self, dst: int, array: np.ndarray, **kw: Any) -> None:
        now = time.monotonic()
        if self._active:
            self._active = [(f, end) for f, end in self._active if end > now]
        for fault, end in self._active:
            if fault.peer is not None and fault.peer != dst:
                continue
            if fault.kind == "delay":
                await asyncio.sleep(fault.delay_s + self._rng.random() * fault.jitter_s)
            elif fault.kind == "throttle":
                await asyncio.sleep(array.nbytes * 8 / (fault.rate_mbps * 1e6))
            elif fault.kind == "blackhole":
                await asyncio.sleep(max(0.0, end - time.monotonic()))
        flip = next((f for f in self._flips if f.peer in (None, dst)), None)
        mesh = self.transport
        if flip is not None and array.nbytes >= _FLIPPED_WRITE and isinstance(mesh, TcpMesh):
            self._flips.remove(flip)
            await mesh.ensure([dst])
            conn = mesh.connection(dst)
            if conn is not None and conn.transport is not None:
                conn.transport = _Tap(conn, conn.transport)  # type: ignore[assignment]
        await self._send(dst, array, **kw)

    def _reset(self, peer: int | None) -> None:
        mesh = self.transport
        if not isinstance(mesh, TcpMesh):
            return  # no connections to reset (an in-process transport)
        for p in [peer] if peer is not None else mesh.peers():
            conn = mesh.connection(p)
            if conn is not None and conn.transport is not None:
                conn.transport.abort()  # RST: the peer sees the connection reset


_FLIPPED_WRITE = 256  # the smallest write taken for a payload (frame heads are smaller)


class _Tap:
    """A connection's transport that inverts one byte of its first large write, then
    puts the real transport back."""

    def __init__(self, conn: Any, real: Any) -> None:
        self._conn, self._real = conn, real

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes < _FLIPPED_WRITE:
            self._real.write(data)
            return
        corrupted = bytearray(view)
        corrupted[len(corrupted) // 2] ^= 0xFF
        self._conn.transport = self._real
        self._real.write(bytes(corrupted))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
