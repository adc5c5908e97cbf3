"""Test script: every rank all_reduces (so it holds a connection to another rank), then
prints ``rank R tcp JSON``: the congestion control and unsent low-water mark each of its
peer connections uses."""

from __future__ import annotations

import json

import numpy as np

import shardwire.worker as sw
from shardwire.worker.transport import tcptuning


async def main() -> None:
    async with sw.init() as pg:
        total = await pg.all_reduce(np.ones(1024))
        assert np.array_equal(total, np.full(1024, float(pg.world_size))), total[:4]
        mesh = pg.transport
        conns = [mesh.connection(peer) for peer in mesh.peers()]
        used = [tcptuning.used(c.socket) for c in conns if c is not None and c.socket]
        print(f"rank {pg.rank} tcp {json.dumps(used)}", flush=True)
        await pg.barrier()


if __name__ == "__main__":
    sw.run(main())
