"""Each rank sends a tensor to its right neighbour and prints what its left one sent.

Run it with:  shardwire launch --standalone --nproc-per-node 4 examples/hello.py
"""

from __future__ import annotations

import asyncio

import numpy as np

import shardwire.worker as sw


async def main() -> None:
    async with sw.init() as pg:
        right = (pg.rank + 1) % pg.world_size
        left = (pg.rank - 1) % pg.world_size
        mine = np.full(4, pg.rank, dtype=np.float32)
        received, _ = await asyncio.gather(
            pg.transport.recv(left, tag=sw.Tag(0, 0)),
            pg.transport.send(right, mine, tag=sw.Tag(0, 0)),
        )
        print(
            f"rank {pg.rank}/{pg.world_size} (node {pg.node_rank}, local {pg.local_rank}) "
            f"received {received.tolist()} from rank {left}"
        )


if __name__ == "__main__":
    sw.run(main())
