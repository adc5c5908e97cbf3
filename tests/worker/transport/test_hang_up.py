"""Hanging up leaves no sender waiting. (That the peer still reads the last frame is
checked end to end in tests/e2e/test_shm.py, where a reset used to lose it.)"""

from __future__ import annotations

import asyncio

import numpy as np

from shardwire.protocol import Tag

from .fabric import tcp_world


async def test_queued_sends_fail_at_once_when_the_connection_hangs_up() -> None:
    # checksummed payloads over 8 MiB go through the writer task
    async with tcp_world(2, timeout=30.0, checksum=True) as (a, b):
        await a.ensure([1])
        conn = a.connection(1)
        assert conn is not None
        big = np.ones(16 << 20, np.uint8)
        first = asyncio.ensure_future(a.send(1, big, tag=Tag(0, 1), op="x", timeout=60))
        second = asyncio.ensure_future(a.send(1, big, tag=Tag(0, 2), op="x", timeout=60))
        await asyncio.sleep(0)  # both queued behind each other, the writer not yet run
        writer = conn.outbox.task
        assert writer is not None
        conn.hang_up()
        async with asyncio.timeout(5):
            results = await asyncio.gather(first, second, return_exceptions=True)
        # each fails at once, saying why
        assert [type(r) for r in results] == [ConnectionResetError] * 2, results
        assert all(str(r) == "connection closed while sending" for r in results), results
        assert writer.cancelled()  # stopped before it wrote a byte, not left to finish
        del b
