"""Test script: each rank draws samples from its own data order, all-reduces them into
weights every rank holds alike, notes each step's state for a chaos plan's checks
(``pg.step_finished``) and saves its last two steps to ``STATE_DIR``. A restarted rank
resumes at the newest step every rank saved. With ``FORGET=1`` it forgets to restore
its data order: the bug the plan's "data once" invariant must catch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from pathlib import Path

import numpy as np

import shardwire.worker as sw


async def main() -> None:
    steps, where = int(os.environ.get("STEPS", "30")), Path(os.environ["STATE_DIR"])
    async with sw.init() as pg:
        path = where / f"rank{pg.rank}.json"
        draw = np.random.default_rng(pg.rank)  # this rank's data order
        saved = json.loads(path.read_text()) if path.exists() else {}
        newest = max(map(int, saved), default=0)
        first = int((await pg.all_reduce(np.array([newest]), op=sw.ReduceOp.MIN))[0])
        weights = np.zeros(4)
        if first:
            weights = np.array(saved[str(first)]["weights"])
            if os.environ.get("FORGET") != "1":
                draw.bit_generator.state = saved[str(first)]["draw"]
        for step in range(first + 1, steps + 1):
            batch = draw.integers(0, 1000, 8)
            summed = await pg.all_reduce(batch.astype(np.float64))
            weights = weights + summed[:4] / 1e4
            held = functools.partial(lambda w: ("whole", [w]), weights)
            pg.step_finished(step, sw.StepState(read=batch, held=held, loss=float(weights.sum())))
            state = {"weights": weights.tolist(), "draw": draw.bit_generator.state}
            saved = {k: v for k, v in saved.items() if int(k) == step - 1} | {str(step): state}
            path.with_suffix(".new").write_text(json.dumps(saved))
            os.replace(path.with_suffix(".new"), path)  # whole, even if the rank dies here
            await asyncio.sleep(0.05)


if __name__ == "__main__":
    sw.run(main())
