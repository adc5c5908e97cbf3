"""A Ray driver that calls ``shardwire.ray.run`` from Python (run by the tests with the
cluster's address and a case): prints the outcome as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import ray

import shardwire.ray as swr
import shardwire.worker as sw


def _niceness(thread: str) -> int:
    return os.getpriority(os.PRIO_PROCESS, int(thread))


def rank_sum(scale: float) -> dict:
    """A function target: joins the job from its environment, all-reduces."""

    async def main() -> dict:
        async with sw.init() as pg:
            total = await pg.all_reduce(np.array([float(pg.rank) * scale]))
            return {
                "sum": float(total[0]),
                "rank": pg.rank,
                "run_id": os.environ["SHARDWIRE_RUN_ID"],
                "node": os.environ["SHARDWIRE_NODE_ID"],
                "niceness": sorted(set(map(_niceness, os.listdir("/proc/self/task")))),
            }

    return asyncio.run(main())


def main(address: str, case: str) -> None:
    ray.init(address=address, include_dashboard=False)
    options = {"num_workers": 4, "workers_per_node": 2, "run_id": "fn-job"}
    try:
        if case == "function":
            out = swr.run(
                rank_sum,
                (2.0,),
                **options,
                resources_per_worker={"trainer": 1},
                strategy="STRICT_SPREAD",
            )
        elif case == "too-much-of-a-resource":
            out = swr.run(rank_sum, (1.0,), **options, resources_per_worker={"trainer": 2})
        elif case == "held-elsewhere":
            # every CPU taken by another placement: the job waits, then gives up
            hold = ray.util.placement_group([{"CPU": 2}] * 2, strategy="STRICT_SPREAD")
            ray.get(hold.ready(), timeout=60)
            out = swr.run(rank_sum, (1.0,), **options, placement_timeout=3)
        else:
            raise SystemExit(f"no case {case}")
    except swr.PlacementUnavailable as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        return
    print(json.dumps({"result": out}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
