"""A Ray Train driver: a small model trained by ``TorchTrainer`` on 2 workers, wrapped
in DDP and then, in the same run, in FSDP2, over the backend named (``shardwire``
through ``ShardwireConfig``, or ``gloo``); prints rank 0's final parameters of each
(written to a file both share: one machine), the backend its group used and the
single-process oracle's parameters, as JSON."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn

from shardwire.ray.train import ShardwireConfig

STEPS = 12
WRAPS = ("ddp", "fsdp2")
ROWS = 32


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def flat(state: dict) -> list[float]:
    return [float(v) for key in sorted(state) for v in state[key].flatten()]


def train(config: dict) -> None:
    torch.set_num_threads(1)
    said = {wrap: trained(wrap) for wrap in WRAPS}
    if dist.get_rank() == 0:
        said |= {"backend": dist.get_backend(), "world": dist.get_world_size()}
        Path(config["out"]).write_text(json.dumps(said))


def trained(wrap: str) -> list[float]:
    """The model wrapped in ``wrap``, trained on this rank's rows; its full parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, size = dist.get_rank(), dist.get_world_size()
    net = model()
    if wrap == "ddp":
        net = nn.parallel.DistributedDataParallel(net)
    else:
        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    x, y = data()
    mine = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(net(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat(get_model_state_dict(net, options=StateDictOptions(full_state_dict=True)))


def oracle() -> list[float]:
    """One process, the whole batch: what averaging the ranks' gradients computes."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    x, y = data()
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat(net.state_dict())


def main(address: str, backend: str) -> None:
    ray.init(address=address, include_dashboard=False)
    config = ShardwireConfig() if backend == "shardwire" else TorchConfig(backend="gloo")
    out = Path(tempfile.mkdtemp(prefix="ray-train-out-")) / "rank0.json"
    trainer = TorchTrainer(
        train,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=config,
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="ray-train-")),
    )
    trainer.fit()
    print(json.dumps({**json.loads(out.read_text()), "oracle": oracle()}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
