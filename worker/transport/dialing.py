"""Connections made on first use: a rank connects to a peer when it first sends to it.

Theory of operation
-------------------
1. The first send (or ``ensure``) to a peer without a connection opens a *link*: one
   dial task, owned here, asks the address book where the peer listens, connects and
   runs the handshake (authentication unchanged). At most ``MAX_DIALS`` dial at once.
   A busy listener or a connection reset in the handshake is retried with spread
   backoff, everything bounded by ``connect_timeout``. A refused connection is not
   retried: every rank listens before it joins, so nobody listening means it is gone.
2. Frames sent meanwhile wait in the link's backlog, in order, and go out the moment a
   connection registers, ahead of anything sent later.
3. Two ranks may dial each other at once. The higher rank's dial wins: a rank dialling
   a lower rank answers that rank's hello with ``crossed``, and the lower rank then
   waits for the inbound connection. A hello accepted from a peer counts as the link
   being made, so this rank waits for that handshake rather than dial a second time.
4. A peer that refuses or cannot be reached in time fails the link with ``PeerFailed``
   naming it (reported to the coordinator); a refused handshake (wrong token, protocol)
   or a peer certificate this rank does not trust fails it at once with
   ``ConnectFailed``, this rank's own error. Either poisons the transport.
"""

from __future__ import annotations

import asyncio
import random
import ssl
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardwire.protocol import PeerFailed, RendezvousError, ShardwireError, TensorMeta

if TYPE_CHECKING:
    from shardwire.worker.transport.mesh import TcpMesh
    from shardwire.worker.transport.peer import PeerConnection

MAX_DIALS = 32  # dials under way at once, per rank
CROSSED = "crossed"  # handshake refusal: the other rank's dial makes this link


_NO_ATTEMPT = "no attempt finished"
_CROSSED = "it was connecting to this rank itself"
# Dials that never finish (no refusal, no answer) are what a firewall dropping the port
# does; so is a crossed dial whose other half never arrives (this rank's port dropped).
_FIREWALL = "does a firewall drop {}? --peer-port-range pins the ports to open"


def _why(last: str, own_port: int) -> str:
    """The end of an unreachable peer's reason: the last attempt, and a hint where a
    firewall explains it (which side's port it drops)."""
    if last == _NO_ATTEMPT:
        return f"({last}: {_FIREWALL.format('that port')})"
    if last == _CROSSED:
        here = f"this rank's port {own_port}"
        return f"({last}, but its connection never arrived: {_FIREWALL.format(here)})"
    return f"({last})"


class ConnectFailed(ShardwireError):
    """A connection to a peer was refused (token, TLS or protocol), not just slow."""


@dataclass(slots=True)
class _Link:
    peer: int
    made: asyncio.Future[None]  # resolved when a connection registers; fails with the link
    backlog: list[tuple[TensorMeta, np.ndarray, asyncio.Future[Any] | None]] = field(
        default_factory=list
    )
    dialing: bool = False  # this rank's dial is under way
    inbound: int = 0  # accepted hellos from the peer whose handshake is under way
    waiters: int = 0  # callers of Links.wait
    task: asyncio.Task[None] | None = None


class Links:
    """The links this rank is making, and their dials (owned)."""

    def __init__(self, mesh: TcpMesh):
        self._mesh = mesh
        self._links: dict[int, _Link] = {}
        self._slots = asyncio.Semaphore(MAX_DIALS)
        self._tasks: set[asyncio.Task[None]] = set()
        self.dials = 0  # handshakes this rank started

    def refuses(self, peer: int) -> bool:
        """Whether a hello from ``peer`` loses to this rank's own dial (the higher rank's
        dial wins)."""
        link = self._links.get(peer)
        return link is not None and link.dialing and self._mesh.rank > peer

    # ---- sending before the connection is up -------------------------------------------

    def send(self, peer: int, meta: TensorMeta, array: np.ndarray) -> Coroutine[Any, Any, None]:
        """Queue a frame for ``peer``; the result completes once ``array`` may change."""
        slot = asyncio.get_running_loop().create_future()
        self._want(peer).backlog.append((meta, array, slot))
        return self._sent(slot)

    def post(self, peer: int, meta: TensorMeta, array: np.ndarray) -> None:
        """Queue a small frame nobody waits on (copied)."""
        self._want(peer).backlog.append((meta, array.copy(), None))

    @staticmethod
    async def _sent(slot: asyncio.Future[Any]) -> None:
        try:
            pending = await slot  # the outbox's own wait, once the frame was handed to it
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled() and asyncio.iscoroutine(slot.result()):
                slot.result().close()  # handed over as this sender gave up: not awaited
            raise
        if pending is not None:
            await pending

    async def wait(self, peer: int) -> None:
        """Return once ``peer`` is connected (raises why if it cannot be)."""
        link = self._want(peer)
        link.waiters += 1
        try:
            await asyncio.shield(link.made)
        finally:
            link.waiters -= 1

    # ---- link life ---------------------------------------------------------------------

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link(peer, asyncio.get_running_loop().create_future())
        return link

    def _want(self, peer: int) -> _Link:
        link = self._link(peer)
        if link.task is None and link.inbound == 0:
            link.dialing = True
            link.task = asyncio.create_task(self._dial(link), name=f"dial-{peer}")
            self._tasks.add(link.task)
            link.task.add_done_callback(self._tasks.discard)
        return link

    def expect(self, peer: int) -> None:
        """A hello from ``peer`` was accepted: its handshake makes the link."""
        self._link(peer).inbound += 1

    def inbound_failed(self, peer: int) -> None:
        """An accepted handshake from ``peer`` failed: dial if someone still waits."""
        link = self._links.get(peer)
        if link is None:
            return
        link.inbound -= 1
        if link.inbound == 0 and link.task is None:
            if link.backlog or link.waiters:
                self._want(peer)
            else:
                del self._links[peer]

    def connected(self, conn: PeerConnection) -> None:
        """``conn`` registered: send the backlog through it, in order. A dial of this
        rank still under way ends by itself (refused as crossed); it is not cancelled in
        the middle of a handshake the peer may complete."""
        link = self._links.pop(conn.peer, None)
        if link is None:
            return
        for meta, array, slot in link.backlog:
            if slot is not None and slot.cancelled():
                continue  # its sender gave up before the connection came
            try:
                if slot is None:
                    conn.outbox.post(meta, array)
                else:
                    slot.set_result(conn.outbox.send(meta, array))
            except (ConnectionError, ShardwireError) as exc:
                if slot is not None:
                    slot.set_exception(exc)
        if not link.made.done():
            link.made.set_result(None)

    async def _dial(self, link: _Link) -> None:
        mesh, peer = self._mesh, link.peer
        limit = mesh.config.connect_timeout
        where, last = f"rank {peer}", _NO_ATTEMPT
        try:
            async with asyncio.timeout(limit):
                host, port = await mesh.book.address(peer)
                where = f"rank {peer} at {host}:{port}"
                delay = 0.05
                while not link.made.done():  # bounded by the connect timeout
                    try:
                        async with self._slots:  # never held while waiting for the peer
                            if link.made.done():
                                break  # the peer's connection came first
                            self.dials += 1
                            await mesh.dial(peer, host, port)
                        return
                    except RendezvousError as exc:
                        if exc.code == CROSSED:
                            last = _CROSSED
                            break
                        if exc.code != "busy":
                            raise
                        last = "its listener was busy"
                    except ssl.SSLCertVerificationError as exc:  # no retry makes it trusted
                        raise ConnectFailed(
                            f"its certificate is not signed by this job's authority ({exc})"
                        ) from exc
                    except ConnectionRefusedError as exc:  # it listened before it joined
                        raise PeerFailed(
                            rank=peer, reason=f"refused the connection at {host}:{port} ({exc})"
                        ) from exc
                    except OSError as exc:
                        last = str(exc) or type(exc).__name__
                    await asyncio.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
                link.dialing = False
                await asyncio.shield(link.made)  # the peer's dial makes the link
        except TimeoutError:
            self._failed(
                link,
                PeerFailed(
                    rank=peer,
                    reason=f"unreachable: no connection with {where} within {limit:g} s "
                    + _why(last, mesh.listen_port),
                ),
            )
        except (ShardwireError, LookupError) as exc:
            error = (
                exc
                if isinstance(exc, PeerFailed)
                else ConnectFailed(f"rank {mesh.rank}: cannot connect to {where}: {exc}")
            )
            self._failed(link, error)
        finally:
            link.dialing = False
            link.task = None

    def _failed(self, link: _Link, error: ShardwireError) -> None:
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        self._fail(link, error)
        self._mesh.link_failed(error)

    @staticmethod
    def _fail(link: _Link, error: BaseException) -> None:
        for _meta, _array, slot in link.backlog:
            if slot is not None and not slot.done():
                slot.set_exception(error)
        link.backlog.clear()
        if not link.made.done():
            link.made.set_exception(error)
            link.made.exception()  # retrieved: each waiter raises it

    def stop(self, error: BaseException) -> None:
        """Stop every dial and fail what waits on a link with ``error``."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            if link.task is not None:
                link.task.cancel()
            self._fail(link, error)

    async def aclose(self, error: BaseException) -> None:
        """Stop (see :meth:`stop`) and wait for the dial tasks to end."""
        self.stop(error)
        await asyncio.gather(*self._tasks, return_exceptions=True)
