"""N groups over either transport, and a helper that runs one coroutine per rank."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from shardwire.worker.collectives import Group
from tests.worker.transport.fabric import EXTRA_WORLDS, WORLDS

KINDS = sorted(WORLDS)


@contextlib.asynccontextmanager
async def groups_over(
    world: contextlib.AbstractAsyncContextManager, timeout: float
) -> AsyncIterator[list[Group]]:
    """One group per transport of ``world`` (entered here), all closed on the way out."""
    async with world as transports:
        groups = [Group(t, timeout=timeout) for t in transports]
        try:
            yield groups
        finally:
            for g in groups:
                await g.aclose()


def group_world(
    kind: str, n: int, *, timeout: float = 20.0
) -> contextlib.AbstractAsyncContextManager[list[Group]]:
    return groups_over({**WORLDS, **EXTRA_WORLDS}[kind](n, timeout=timeout), timeout)


async def on_all(groups: list[Group], fn: Callable[[Group], Awaitable[Any]]) -> list[Any]:
    """Run ``fn(group)`` for every rank concurrently; results in rank order."""
    async with asyncio.timeout(60):
        return list(await asyncio.gather(*(fn(g) for g in groups)))
