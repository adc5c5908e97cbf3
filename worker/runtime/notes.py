"""Waits on the coordinator, said aloud: while a worker or node agent connects to its
coordinator, or waits for its job to form, a line every few seconds says what it waits
for, what it met last and what to check, so that no wait is silent (the default bounds
are minutes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("shardwire.worker")

NOTE_EVERY = 5.0  # seconds between the lines
CONNECT_HINT = "is it started, and is its port open to this host?"
FORM_HINT = "are the job's other processes started? Every rank is placed once all have joined"


class WaitNotes:
    """One wait's lines: ``waiting`` says what for, ``last`` what it met last (updated by
    the waiting call as it goes), ``hint`` what to check."""

    def __init__(
        self, waiting: str, timeout: float, *, hint: str = CONNECT_HINT, last: str = "no answer yet"
    ) -> None:
        self.waiting, self.timeout, self.hint, self.last = waiting, timeout, hint, last

    async def note(self, every: float) -> None:
        """Log a line every ``every`` seconds until cancelled (when the wait ends); also
        while one attempt hangs (a firewall that drops a port answers nothing)."""
        start = time.monotonic()
        while True:  # cancelled by around(), whose wait is bounded by its caller
            await asyncio.sleep(every)
            log.warning(
                "%s (%s), %.0f s of %g s; %s",
                self.waiting,
                self.last,
                time.monotonic() - start,
                self.timeout,
                self.hint,
            )

    async def around(self, wait: Awaitable[T], every: float) -> T:
        """``wait``'s result, said every ``every`` seconds while it is awaited."""
        notes = asyncio.create_task(self.note(every), name="shardwire-wait-notes")
        try:
            return await wait
        finally:
            notes.cancel()
            await asyncio.gather(notes, return_exceptions=True)
