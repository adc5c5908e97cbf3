"""Test script: every rank checks an all_gather of uneven parts of about 1 MiB (large
enough for the node arena to read them from their owners' memory) against numpy three
times, then prints ``read RANK BYTES``: the bytes its arena read from the others'
memory (0 where it keeps to the shared region)."""

from __future__ import annotations

import numpy as np

import shardwire.worker as sw


async def main() -> None:
    async with sw.init() as pg:
        n, r = pg.world_size, pg.rank
        sizes = [(1 << 18) + 1000 * q for q in range(n)]
        parts = [np.arange(s, dtype=np.float32) + q * 1e6 for q, s in enumerate(sizes)]
        for _ in range(3):
            got = await pg.all_gather(parts[r], sizes=sizes)
            np.testing.assert_array_equal(got, np.concatenate(parts))
        read = pg.backend.gate.arena.context.read
        print(f"read {r} {read}", flush=True)


if __name__ == "__main__":
    sw.run(main())
