"""FSDP2 training that goes on through a rank's death in its processes (live recovery).

    shardwire launch --standalone --nproc-per-node 4 --max-restarts 1 --recovery live \
        reform.py DIR STEPS KILL_AT

Every 4 steps the model and optimizer are saved with ``torch.distributed.checkpoint``
under DIR. Rank 1 kills itself (SIGKILL) as it starts step KILL_AT (once: a file in DIR
marks it; -1: never). The others see ``PeerFailed``; ``shardwire.torch.recovering``
re-forms the default group in their processes, and ``train`` builds the model again and
loads the newest checkpoint. Each rank prints its process id whenever ``train`` starts;
rank 0 prints the digest of the final parameters.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import shardwire.torch as swt

EVERY = 4
BATCH = 16


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g)
    return x, torch.tanh(x @ torch.ones(6, 3) / 3)


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(net)


def newest(root: Path) -> int:
    done = [int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "done").exists()]
    return max(done, default=0)


def train(root: Path, steps: int, kill_at: int) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} pid {os.getpid()} trains", flush=True)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    start = newest(root)
    if start:
        model_state, optim_state = get_state_dict(net, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(root / f"step-{start}"))
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        print(f"rank {rank} resumes at step {start}", flush=True)
    for step in range(start, steps):
        marker = root / "killed"
        if step == kill_at and rank == 1 and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        rows = torch.arange(BATCH).chunk(world)[rank]
        loss = F.mse_loss(net(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % EVERY == 0:
            model_state, optim_state = get_state_dict(net, opt)
            where = root / f"step-{step + 1}"
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(where))
            dist.barrier()
            if rank == 0:
                (where / "done").write_text("")
    digest = hashlib.sha256()
    for name, value in net.state_dict().items():
        digest.update(name.encode() + value.full_tensor().detach().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    root, steps, kill_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("shardwire")
    digest = swt.recovering(lambda: train(root, steps, kill_at))
    if dist.get_rank() == 0:
        print(f"final {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
