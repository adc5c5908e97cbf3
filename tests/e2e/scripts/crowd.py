"""Test script: every rank checks all_reduce, reduce_scatter and broadcast against numpy
(1 MiB and 6 MiB, more than a slot; reduce_scatter's shares an eighth of that) and
all_gather at 1 MiB (the world's parts: 32 MiB at 32 ranks; parts of several slots are
the arena tests'), and rank 0 prints how many bytes /dev/shm holds while the world group's node
arena is open (``shm-used BYTES``); every rank ends with ``ok RANK``."""

from __future__ import annotations

import os

import numpy as np

import shardwire.worker as sw


def _used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


async def main() -> None:
    async with sw.init() as pg:
        n, r = pg.world_size, pg.rank
        for elems in (1 << 18, 3 << 19):
            base = np.arange(elems, dtype=np.float32) % 97
            mine = base + r
            total = base * n + sum(range(n))  # exact in float32: small integers
            np.testing.assert_array_equal(await pg.all_reduce(mine.copy()), total)
            if elems == 1 << 18:  # at 6 MiB, 32 ranks would copy 6 GiB between them
                gathered = await pg.all_gather(mine)
                for q in range(n):
                    np.testing.assert_array_equal(gathered[q * elems : (q + 1) * elems], base + q)
                del gathered
            part = elems // 8  # the whole input is n parts: 24 MiB at most per rank
            share = await pg.reduce_scatter(np.tile(mine[:part], n))
            np.testing.assert_array_equal(share, total[:part])
            np.testing.assert_array_equal(await pg.broadcast(mine.copy(), root=n - 1), base + n - 1)
        if r == 0:
            print(f"shm-used {_used()}", flush=True)
        await pg.barrier()
        print(f"ok {r}", flush=True)


if __name__ == "__main__":
    sw.run(main())
