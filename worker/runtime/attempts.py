"""Dialing a coordinator that may still be starting: which failures to retry, and the
retry loop (jittered, doubling backoff) that the control connection's first connect runs."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from shardwire.protocol import RendezvousError, ShardwireError
from shardwire.worker.runtime.notes import WaitNotes


class CoordinatorUnreachable(ShardwireError):
    """No coordinator answered at the given address in time."""


# Failures of one attempt that a coordinator still starting explains: retried.
_NOT_YET = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}
# Connections closed during the handshake that are retried before it is taken for a
# refusal (a TLS coordinator dialed in plain text closes every one): a coordinator
# killed in the middle of one and started again by its launcher is back within a second.
_CLOSES = 3


def not_yet(exc: OSError) -> str | None:
    """Why an attempt failed, if trying again later may succeed; None if not."""
    if isinstance(exc, socket.gaierror):
        return f"the name did not resolve ({exc.strerror})"
    if exc.errno in _NOT_YET:  # the stock loop's strerror is "Connect call failed (...)"
        return os.strerror(exc.errno)
    return None


async def attempts(dial: Callable[[], Awaitable[Any]], timeout: float, tries: WaitNotes) -> None:
    """Run ``dial`` until one attempt succeeds or ``timeout`` passes (TimeoutError);
    "busy" refusals and the failures :func:`not_yet` names are retried, others raise."""
    delay, closes = 0.05, 0
    async with asyncio.timeout(timeout):
        while True:
            try:
                await dial()
                return
            except RendezvousError as exc:
                if exc.code not in ("busy", "deposed"):
                    raise
                tries.last = str(exc) if exc.code == "deposed" else "the coordinator was busy"
            except OSError as exc:
                why = not_yet(exc)
                if why is None and isinstance(exc, ConnectionError) and closes < _CLOSES:
                    closes += 1  # a coordinator killed mid-handshake, started again at once
                    why = "the connection closed during the handshake"
                if why is None:
                    raise
                tries.last = why
            await asyncio.sleep(delay * (0.5 + random.random()))  # spread the retries
            delay = min(delay * 2, 1.0)
