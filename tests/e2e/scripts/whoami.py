"""Test script: every rank checks an all_reduce and an all_gather of its rank against
numpy, then prints ``rank R of W local L of LW node N id NODE_ID ok`` (one line; the
node id is the one its launcher gave, SHARDWIRE_NODE_ID)."""

from __future__ import annotations

import os

import numpy as np

import shardwire.worker as sw


async def main() -> None:
    async with sw.init() as pg:
        total = await pg.all_reduce(np.full(1000, float(pg.rank)))
        gathered = await pg.all_gather(np.array([float(pg.rank)]))
        world = pg.world_size
        assert np.array_equal(total, np.full(1000, world * (world - 1) / 2)), total[:4]
        assert np.array_equal(gathered, np.arange(world, dtype=float)), gathered
        node_id = os.environ.get("SHARDWIRE_NODE_ID", "?")
        print(
            f"rank {pg.rank} of {world} local {pg.local_rank} of {pg.local_world_size} "
            f"node {pg.node_rank} id {node_id} ok",
            flush=True,
        )


if __name__ == "__main__":
    sw.run(main())
