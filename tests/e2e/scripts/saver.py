"""Test script: FSDP training that saves a checkpoint after every step, resuming from the
latest one in CKPT if there is one. Prints ``saved N`` after each save and, at the end,
``final DIGEST`` (a digest of every parameter, alike on every rank)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

import shardwire.worker as sw
from shardwire.worker.fsdp import FSDP, by_type, latest_checkpoint
from shardwire.worker.nn import Linear, ReLU, Sequential, mse
from shardwire.worker.optim import AdamW


async def main() -> None:
    steps, ckpt = int(os.environ["STEPS"]), os.environ["CKPT"]
    rng = np.random.default_rng(0)
    model = Sequential(Linear(128, 256, rng=rng), ReLU(), Linear(256, 128, rng=rng))
    async with sw.init() as pg:
        fsdp = await FSDP.create(
            model, pg, optimizer=AdamW(lr=1e-3), policy=by_type(Linear), strategy="full_shard"
        )
        draw = np.random.default_rng(1)
        first = 0
        if latest_checkpoint(ckpt) is not None:
            first = (await fsdp.load(ckpt, rngs={"draw": draw})).step
        rows = np.array_split(np.arange(8), pg.world_size)[pg.rank]
        for step in range(first, steps):
            x = draw.standard_normal((8, 128))
            fsdp.zero_grad()
            out = await fsdp.forward(x[rows])
            _, grad = mse(out, x[rows], denom=8)
            await fsdp.backward(grad)
            await fsdp.step()
            await fsdp.save(ckpt, step=step + 1, rngs={"draw": draw}, keep=2)
            print(f"saved {step + 1}", flush=True)
        state = await fsdp.state_dict()
        digest = hashlib.blake2b(b"".join(state[k].tobytes() for k in sorted(state)))
        print(f"final {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    sw.run(main())
