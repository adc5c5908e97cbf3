"""Test script: every rank checks an all_reduce against numpy, then prints ``rank R
local L listens on PORT`` (its peer listener's port)."""

from __future__ import annotations

import numpy as np

import shardwire.worker as sw


async def main() -> None:
    async with sw.init() as pg:
        total = await pg.all_reduce(np.full(64, float(pg.rank)))
        world = pg.world_size
        assert np.array_equal(total, np.full(64, world * (world - 1) / 2)), total[:4]
        port = pg.transport.listen_port
        print(f"rank {pg.rank} local {pg.local_rank} listens on {port}", flush=True)


if __name__ == "__main__":
    sw.run(main())
