"""torch.distributed.checkpoint of an FSDP2 model over the shardwire backend: save,
load into a differently initialised model, compare full parameters.

    python checkpoint.py DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard

import shardwire.torch  # noqa: F401


def sharded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def main() -> None:
    where = sys.argv[1]
    dist.init_process_group("shardwire")
    net = sharded(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(4, 6)).sum().backward()
    opt.step()
    dcp.save({"model": net.state_dict()}, checkpoint_id=where)
    saved = {k: v.full_tensor().clone() for k, v in net.state_dict().items()}
    other = sharded(1)
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=where)
    other.load_state_dict(state["model"])
    for name, value in other.state_dict().items():
        if not torch.equal(value.full_tensor(), saved[name]):
            raise AssertionError(f"{name} differs after loading")
    print("restored", len(saved), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
