"""Closing idle peer connections (``MeshConfig.idle_close`` seconds), so that a rank
holds descriptors only for the peers it is using now.

Theory of operation
-------------------
A sweep runs every ``idle_close / 2`` seconds. A connection whose frame count did not
move since the previous sweep, with nothing queued, arriving, deferred or in shared
memory, is proposed for release: this rank sends ``Release`` and marks it. The peer
answers ``ReleaseAnswer(ok=True)`` only if the connection is quiet on its side too; from
that moment it sends nothing more on it and forgets it (its next send to this rank
dials again), but reads on. The proposer, on that answer, forgets the connection too
and hangs up once its own queued frames are out, so every frame either side wrote
arrives. ``ok=False`` leaves it open (it may be proposed again). When both propose at
once, the lower rank answers yes (if quiet) and the higher rank no, so one proposal
decides. A released connection closing is never a failure: the mesh no longer
lists it. A hello from a peer whose connection this rank is releasing is accepted (it
replaces the connection).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from shardwire.protocol.messages import Release, ReleaseAnswer

if TYPE_CHECKING:
    from shardwire.worker.transport.mesh import TcpMesh
    from shardwire.worker.transport.peer import PeerConnection


class IdleCloser:
    """One mesh's sweeps and release handshakes (the sweep task is owned here)."""

    def __init__(self, mesh: TcpMesh, after: float):
        self._mesh = mesh
        self.after = after
        self._seen: dict[PeerConnection, int] = {}  # frame count at the last sweep
        self._task: asyncio.Task[None] | None = None
        self.released = 0  # connections closed for idleness
        self.retired: set[PeerConnection] = set()  # released, not closed yet

    def start(self) -> None:
        if self.after > 0 and self._task is None:
            self._task = asyncio.create_task(self._sweeps(), name="shardwire-idle-close")

    async def _sweeps(self) -> None:
        while True:  # ends when the mesh closes (cancelled)
            await asyncio.sleep(self.after / 2)
            self.sweep()

    def sweep(self) -> None:
        seen, self._seen = self._seen, {}
        mesh = self._mesh
        for conn in [c for p in mesh.peers() if (c := mesh.connection(p)) is not None]:
            moved = conn.moves != seen.get(conn, -1)
            self._seen[conn] = conn.moves
            if moved or not conn.quiet() or conn.releasing:
                continue
            conn.releasing = True
            conn.write_message(Release())

    def on_message(self, conn: PeerConnection, msg: Release | ReleaseAnswer) -> None:
        mesh = self._mesh
        current = mesh.connection(conn.peer) is conn
        if isinstance(msg, Release):
            if not current:  # replaced or released here already: nothing is sent on it
                conn.write_message(ReleaseAnswer(ok=True))
                self.retired.add(conn)
                return
            both = conn.releasing and mesh.rank > conn.peer  # the higher rank's stands
            ok = not both and conn.quiet()
            conn.write_message(ReleaseAnswer(ok=ok))
            if ok:
                self._forget(conn)  # nothing more is sent on it; reading goes on
            return
        if not conn.releasing:
            return
        conn.releasing = False
        if msg.ok:
            if current:
                self._forget(conn)
            conn.retire()  # hangs up once its queued frames are out

    def _forget(self, conn: PeerConnection) -> None:
        self._mesh.forget(conn)
        self._seen.pop(conn, None)
        self.retired.add(conn)
        self.released += 1

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
