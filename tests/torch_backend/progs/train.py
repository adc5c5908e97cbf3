"""A small torch training run for the backend tests: the same steps over any backend.

    python train_prog.py BACKEND MODE OUT
    (MODE: ddp | fsdp | fsdp-keep | fsdp-mixed | ddp-sgd | diloco-sgd | diloco
           | diloco-ddp | diloco-fsdp | diloco-fsdp-int8 | diloco-ddp-int8)

The ``diloco-ddp``/``diloco-fsdp`` modes run on 4 ranks as 2 replicas of 2 ranks (a
2 x 2 device mesh): each replica trains with DDP or FSDP2 over its 2 ranks, and DiLoCo's
outer step runs over the mesh's replica dimension (the same shard of every replica).

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


def replicas() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """2 replicas of 2 ranks: (this rank's replica's group, its outer group)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "inner"))
    return mesh["inner"].get_group(), mesh["replica"].get_group()


def wrap(net: nn.Module, mode: str, inner: dist.ProcessGroup | None = None) -> nn.Module:
    if mode.startswith(("diloco-ddp", "diloco-fsdp")):
        if mode.startswith("diloco-ddp"):
            return nn.parallel.DistributedDataParallel(net, process_group=inner)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(inner, "cpu")
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)
    if mode.startswith("diloco"):  # every rank a replica of its own
        return net
    if mode in ("ddp", "ddp-sgd"):
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


def full_of(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def main() -> None:
    backend, mode, out = sys.argv[1:4]
    dist.init_process_group(backend)
    rank = dist.get_rank()
    inner = outer_group = None
    if mode.startswith(("diloco-ddp", "diloco-fsdp")):
        inner, outer_group = replicas()
    net = wrap(model(), mode, inner)
    if mode.endswith("sgd"):
        opt: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outer = None
    if mode.startswith("diloco"):
        from shardwire.torch.diloco import TorchDiLoCo

        # diloco-sgd: every step, the plain average (DDP with SGD); diloco: the paper's
        plain = {"every": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}
        options = plain if mode == "diloco-sgd" else {"every": 2, "quantize": "int8"}
        if outer_group is not None:  # the paper's outer Nesterov, every 2 steps
            options = {"every": 2, "fragments": 2}
            if mode.endswith("int8"):
                options["quantize"] = "int8"
        outer = TorchDiLoCo(net, outer_group, **options)
        outer.begin()
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        if not mode.endswith("sgd"):
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if outer is not None:
            outer.step()
        losses.append(float(loss.detach()))
    if outer is not None:
        outer.finish()  # every replica holds the global parameters, to the bit
        flat = torch.cat([full_of(p).detach().reshape(-1) for p in net.parameters()])
        every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        if not all(torch.equal(every[0], e) for e in every):
            raise SystemExit("DiLoCo replicas differ after finish()")
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
