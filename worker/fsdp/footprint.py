"""Per-rank memory accounting of an FSDP model, by category."""

from __future__ import annotations

from shardwire.worker.fsdp.offload import Offload
from shardwire.worker.fsdp.strategy import Strategy
from shardwire.worker.fsdp.unit import Unit
from shardwire.worker.optim.optimizers import Optimizer


def stats(
    units: list[Unit], strategy: Strategy, optimizer: Optimizer, offload: Offload | None
) -> dict[str, dict[str, int]]:
    """ "estimated": what the strategy implies between steps; "held": what is in memory
    now (full gathered buffers included); "offloaded": what lives in offload files."""
    padded = sum(u.layout.padded * u.layout.dtype.itemsize for u in units)
    shard = sum(u.shard.nbytes for u in units)
    slots = len(optimizer.state[0]) if optimizer.state else 0
    full_params = strategy in (Strategy.NO_SHARD, Strategy.SHARD_GRAD_OP)
    estimated = {
        "params": padded + (shard if strategy is Strategy.SHARD_GRAD_OP else 0)
        if full_params
        else shard,
        "grads": shard,
        "optimizer": slots * shard,
    }
    off = offload or Offload(params=False, grads=False, optimizer=False)
    shards = 0 if off.params else shard
    grad_shards = 0 if off.grads else sum(u.grad_shard.nbytes for u in units)
    state = optimizer.state_bytes()
    held = {
        "params": shards
        + sum(u.full.nbytes for u in units if u.full is not None and u.full is not u.shard),
        "grads": grad_shards + sum(u.grad_full.nbytes for u in units if u.grad_full is not None),
        "optimizer": 0 if off.optimizer else state,
    }
    offloaded = {
        "params": shard if off.params else 0,
        "grads": sum(u.grad_shard.nbytes for u in units) if off.grads else 0,
        "optimizer": state if off.optimizer else 0,
    }
    return {"estimated": estimated, "held": held, "offloaded": offloaded}
