"""A small torch training run for the backend tests: the same steps over any backend.

    python train_prog.py BACKEND MODE OUT   (MODE: ddp | fsdp | fsdp-keep | fsdp-mixed)

Reads torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or runs under
``shardwire launch``; writes rank 0's final parameters (full tensors) to OUT as .npz.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import shardwire.torch  # noqa: F401  (registers the backend)

STEPS = 4
BATCH = 8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5)
    )


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g))
        for _ in range(STEPS)
    ]


def wrap(net: nn.Module, mode: str) -> nn.Module:
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if mode == "fsdp-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    keep = mode == "fsdp-keep"
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=not keep, **kwargs)
    fully_shard(net, reshard_after_forward=not keep, **kwargs)
    return net


def main() -> None:
    backend, mode, out = sys.argv[1:4]
    dist.init_process_group(backend)
    rank = dist.get_rank()
    net = wrap(model(), mode)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {}
    for name, p in net.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name.replace("module.", "")] = full.detach().float().numpy()
    if rank == 0:
        np.savez(out, losses=np.array(losses), **params)
    # every rank tears down together: a gloo rank whose peer (the store's host, rank 0)
    # was still saving aborted at exit now and then ("terminate called without an
    # active exception")
    dist.barrier()
    dist.destroy_process_group()
    if backend == "gloo":
        # the baseline only: gloo's process group on the store's host still aborts in a
        # C++ destructor at interpreter exit now and then ("terminate called without an
        # active exception", exit -6) after a clean teardown; its work is done and its
        # file closed, so it leaves without running those destructors
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
