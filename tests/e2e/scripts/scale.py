"""Test script for many ranks: every rank runs every collective once, checks it against
numpy, and prints one line ``scale {json}``: its rank, the seconds from the start of the
script until ``init`` returned, and right after the collectives its open descriptors,
resident memory (MiB) and the peers it holds connections to; then the same once its
connections went idle (``SHARDWIRE_IDLE_CLOSE`` seconds, waited three times over, at
most 30 s). Every rank ends with ``ok RANK``."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

import shardwire.worker as sw

START = time.monotonic()


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _every_collective(pg) -> None:
    n, r = pg.world_size, pg.rank
    for elems in (100, 150_000):  # small, and mid-sized (the logarithmic paths)
        mine = (np.arange(elems) % 7 + r).astype(np.float32)
        want = (np.arange(elems) % 7 * n + sum(range(n))).astype(np.float32)
        np.testing.assert_array_equal(await pg.all_reduce(mine.copy()), want)
    block = np.full(3, r, np.int64)
    gathered = await pg.all_gather(block)
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(n), 3))
    share = await pg.reduce_scatter(np.ones(2 * n, np.float32))
    np.testing.assert_array_equal(share, np.full(2, n, np.float32))
    got = await pg.broadcast(np.full(5, r, np.int32), root=n - 1)
    np.testing.assert_array_equal(got, np.full(5, n - 1))
    reduced = await pg.reduce(np.full(4, r, np.int64), root=1)
    if r == 1:
        np.testing.assert_array_equal(reduced, np.full(4, sum(range(n))))
    rows = await pg.gather(np.full((1, 2), r, np.int16), root=0)
    if r == 0:
        np.testing.assert_array_equal(rows[:, 0], np.arange(n))
    part = await pg.scatter(np.arange(n, dtype=np.int32) if r == 0 else None, root=0)
    assert part.tolist() == [r]
    swapped = await pg.all_to_all(np.full(n, r, np.int32))
    np.testing.assert_array_equal(swapped, np.arange(n))
    assert await pg.broadcast_object({"from": r}, root=2) == {"from": 2}
    names = await pg.gather_object(f"rank-{r}", root=0)
    if r == 0:
        assert names == [f"rank-{q}" for q in range(n)]
    await pg.barrier()


def _fd_kinds() -> dict[str, int]:
    """This process's open descriptors by kind (socket, pipe, anon_inode, /dev/shm...)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory's own descriptor, closed meanwhile
            continue
        kind = target.split(":")[0] if ":" in target else "/".join(target.split("/")[:3])
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _usage(pg) -> dict:
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "fd_kinds": _fd_kinds(),
        "rss_mib": round(_rss_mib(), 1),
        "links": pg.transport.peers(),
        "released": pg.transport.idle.released,
        "dials": pg.transport.links.dials,
    }


async def main() -> None:
    async with sw.init() as pg:
        init_s = time.monotonic() - START
        await _every_collective(pg)
        await pg.barrier()
        stats = {"rank": pg.rank, "init_s": round(init_s, 3), **_usage(pg)}
        await asyncio.sleep(min(30.0, 3 * float(os.environ.get("SHARDWIRE_IDLE_CLOSE", "0"))))
        stats["idle"] = _usage(pg)
        print("scale " + json.dumps(stats), flush=True)
        await asyncio.sleep(1.0)  # every rank measured before any dials again
        await pg.barrier()
        print(f"ok {pg.rank}", flush=True)


if __name__ == "__main__":
    sw.run(main())
