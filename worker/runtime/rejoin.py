"""Riding out a coordinator's absence: reconnect, say who we are, carry on.

A coordinator that keeps a journal says, in every placement, how long to wait for it
(``grace``). When its connection drops, a worker or node agent does not end the job:
the data plane goes on, and :class:`Rejoiner` dials the same address again with jittered
backoff until the grace runs out. Each attempt is a fresh handshake followed by a
``Rejoin`` (``NodeRejoin`` for an agent) that a restarted coordinator checks against its
journal. Once it answers ``Rejoined``, heartbeats resume and a last message written while
it was away (``Leave``, ``Failure``) is sent. A refusal, or the grace running out, ends
the wait: the process hears that the coordinator is lost, as it would have at once.

Before its placement a process has no grace: :func:`join_redialing` asks again instead.
A coordinator killed while the job formed, and started again on its journal, takes
the join as if nothing had happened.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shardwire.protocol import JobAborted, RendezvousError
from shardwire.protocol.messages import NodeRejoin, Rejoin

log = logging.getLogger("shardwire.worker")

_FIRST_DELAY = 0.1  # seconds before the second attempt (doubling, at most _MAX_DELAY)
_MAX_DELAY = 0.5  # a restarted coordinator is back within a second: dial it soon


class Rejoiner:
    """The reconnection of one control connection (owned by its client)."""

    def __init__(
        self,
        *,
        where: Callable[[], str],
        role: str,
        dial: Callable[[], Awaitable[None]],
        rejoin: Callable[[Rejoin | NodeRejoin, float], Awaitable[None]],
        back: Callable[[], None],
        lost: Callable[[str], None],
        away: Callable[[], None] = lambda: None,
    ) -> None:
        self._where = where  # the coordinator's address (the one last dialed)
        self._role = role
        self._dial = dial  # one connection attempt with a fresh handshake
        self._rejoin = rejoin  # send the rejoin and wait (bounded) for Rejoined
        self._back = back  # reconnected: heartbeats resume, a last message goes out
        self._lost = lost  # gave up, with why
        self._away = away  # the connection dropped: the wait for its return begins
        self.grace = 0.0
        self.message: Rejoin | NodeRejoin | None = None
        self.returned = asyncio.Event()
        self.returned.set()  # connected
        self.went = asyncio.Event()  # set when it goes away (cleared when it is back)
        self._task: asyncio.Task[None] | None = None
        self._until = 0.0
        self._closed = False  # closed by its client: it starts nothing more

    @property
    def away(self) -> bool:
        return self._task is not None and not self._task.done()

    def remaining(self) -> float:
        """Seconds of grace left while away (0 when connected)."""
        return max(0.0, self._until - time.monotonic()) if self.away else 0.0

    def start(self) -> bool:
        """The connection dropped: reconnect in the background if a grace was given
        (True), else the caller ends the job (False)."""
        if self.grace <= 0 or self.message is None or self._closed:
            return False
        if self.away:
            return True
        self.returned.clear()
        self.went.set()
        self._until = time.monotonic() + self.grace
        log.warning(
            "%s: lost the coordinator at %s; reconnecting for up to %g s (training goes on)",
            self._role,
            self._where(),
            self.grace,
        )
        self._away()
        self._task = asyncio.create_task(self._run(), name="shardwire-rejoin")
        return True

    async def _run(self) -> None:
        delay, last = _FIRST_DELAY, "no attempt yet"
        assert self.message is not None
        while (left := self._until - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    await self._dial()
                    await self._rejoin(self.message, left)
            except RendezvousError as exc:
                if exc.code in ("rejoin", "run_id", "stale_generation", "auth"):
                    self.grace = 0.0  # given up: the refusal's closed connection is no news
                    self._lost(f"the coordinator at {self._where()} refused to take it back: {exc}")
                    return
                last = str(exc)
            except (OSError, TimeoutError, ConnectionError) as exc:
                last = str(exc) or type(exc).__name__
            else:
                log.warning("%s: reconnected to the coordinator at %s", self._role, self._where())
                self.went.clear()
                self.returned.set()
                self._back()
                return
            await asyncio.sleep(min(delay * (0.5 + random.random()), max(0.0, left)))
            delay = min(delay * 2, _MAX_DELAY)
        grace, self.grace = self.grace, 0.0  # given up, once
        self._lost(
            f"the coordinator at {self._where()} did not come back within {grace:g} s "
            f"(last attempt: {last})"
        )

    async def away_and_back(self, timeout: float) -> None:
        """Until the connection dropped and was taken back (bounded by ``timeout``)."""
        async with asyncio.timeout(timeout):
            await self.went.wait()
            await self.returned.wait()

    async def wait_returned(self, timeout: float) -> bool:
        """Wait (bounded) until connected again; False if still away."""
        if self.returned.is_set():
            return True
        try:
            async with asyncio.timeout(timeout):
                await self.returned.wait()
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


async def join_redialing(
    ask: Callable[[float], Awaitable[Any]],
    *,
    lost: Callable[[], bool],
    redial: Callable[[float], Awaitable[None]],
    timeout: float,
    who: str,
) -> Any:
    """``ask(seconds left)`` until it answers; when it fails because the connection was
    ``lost``, ``redial`` and ask again, all within ``timeout`` (then the last error)."""
    until = time.monotonic() + timeout
    while True:
        try:
            return await ask(max(0.0, until - time.monotonic()))
        except JobAborted:
            left = until - time.monotonic()
            if not lost() or left <= 0:
                raise  # an abort, not a lost connection; or no time left
            log.warning("%s was lost while the job formed; dialing it again", who)
            await redial(left)
