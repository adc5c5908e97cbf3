"""Test script: every rank says it is ready and then waits to be signalled."""

from __future__ import annotations

import asyncio

import shardwire.worker as sw


async def main() -> None:
    async with sw.init() as pg:
        print(f"rank {pg.rank} ready", flush=True)
        await asyncio.sleep(120)


if __name__ == "__main__":
    sw.run(main())
