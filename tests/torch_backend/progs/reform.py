"""Training that goes on through a rank's death in its processes (live recovery).

    shardwire launch --standalone --nproc-per-node 4 --max-restarts 1 --recovery live \
        reform.py DIR STEPS KILL_AT [--wrap ddp|fsdp2] [--during backward|step] \
            [--store disk|peer] [--leave-at STEP]

The model is wrapped in DDP or FSDP2 (``fully_shard``). Every 4 steps the model, the
optimizer and the step are saved with ``torch.distributed.checkpoint``: under DIR
(``disk``), or in the ranks' memory (``peer``: ``shardwire.torch.PeerStorage``, which
the survivors keep through the re-formation). Rank 1 kills itself (SIGKILL) in step
KILL_AT (once: a file in DIR marks it; -1: never), either in the middle of its backward
pass (between the two linear layers' gradients, after the last layer's gradients went on
the wire) or at the start of its optimizer step. The others see the failure in their
next collective (after a ``step`` kill they start it a second late, by when their group
knows of the death: the call fails as it starts); ``shardwire.torch.recovering``
re-forms the default group in their processes, and ``train`` builds the model again and
loads the newest checkpoint (``PeerStorage.latest()`` for ``peer``). With
``--leave-at STEP`` (``peer`` only) rank 1 is sent SIGTERM instead, as it starts step
STEP, with a notice to leave armed: every rank saves at the end of that step and rank 1
leaves with ``LeftJob``; everyone goes on from that step. Each rank prints its process
id whenever ``train`` starts; rank 0 prints the digest of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwire.torch as swt

EVERY = 4
BATCH = 16


class Tripwire(torch.autograd.Function):
    """Identity forward; its backward runs ``fire`` (between two layers' gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fire: Any) -> torch.Tensor:
        ctx.fire = fire
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fire()
        return grad, None


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.last = nn.Linear(16, 3)
        self.fire = lambda: None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(Tripwire.apply(torch.tanh(self.first(x)), self.fire))


def model(wrap: str) -> tuple[nn.Module, Net]:
    torch.manual_seed(0)
    net = Net()
    if wrap == "ddp":
        # buckets small enough that the last layer's gradients leave before the first's
        return DDP(net, bucket_cap_mb=0.0001), net
    fully_shard(net.first)
    fully_shard(net.last)
    return fully_shard(net), net


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 6, generator=g)
    return x, torch.tanh(x @ torch.ones(6, 3) / 3)


def newest(root: Path) -> int:
    done = [int(p.name.split("-")[1]) for p in root.glob("step-*") if (p / "done").exists()]
    return max(done, default=0)


def die(root: Path) -> None:
    marker = root / "killed"
    if not marker.exists():
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)


def state_of(wrapped: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(wrapped, opt)
    return {"model": model_state, "optim": optim_state, "step": step}


def restore(
    root: Path, store: swt.PeerStorage | None, wrapped: nn.Module, opt: torch.optim.Optimizer
) -> int:
    """Load the newest checkpoint into the model and optimizer: its step (0: none).
    The state dict is only asked for when there is one to load: asking initialises the
    optimizer's state (a step of AdamW's count), which a fresh start must not do."""
    if store is not None:
        found = store.latest()
        start = 0 if found is None else -1
    else:
        start = newest(root)
        found = str(root / f"step-{start}") if start else None
    if found is None:
        return 0
    state = state_of(wrapped, opt, 0)
    dcp.load(state, checkpoint_id=found, storage_reader=store)
    set_state_dict(wrapped, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"]) if start < 0 else start


def save(root: Path, store: swt.PeerStorage | None, state: dict[str, Any], step: int) -> None:
    if store is not None:
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=store)
        return
    where = root / f"step-{step}"
    dcp.save(state, checkpoint_id=str(where))
    dist.barrier()
    if dist.get_rank() == 0:
        (where / "done").write_text("")


def train(
    root: Path,
    steps: int,
    kill_at: int,
    wrap: str,
    during: str,
    store: swt.PeerStorage | None,
    leave_at: int = -1,
) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} pid {os.getpid()} trains", flush=True)
    wrapped, net = model(wrap)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
    start = restore(root, store, wrapped, opt)
    if start:
        print(f"rank {rank} resumes at step {start}", flush=True)
    for step in range(start, steps):
        armed = step == kill_at and rank == 1
        net.fire = (lambda: die(root)) if armed and during == "backward" else (lambda: None)
        if step == leave_at and rank == 1 and not (root / "left").exists():
            (root / "left").write_text("")
            os.kill(os.getpid(), signal.SIGTERM)
        if during == "step" and step == kill_at + 1 and rank != 1:
            time.sleep(1.0)  # the next call starts once the death is known
        x, y = batch(step)
        rows = torch.arange(BATCH).chunk(world)[rank]
        loss = F.mse_loss(wrapped(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        if armed and during == "step":
            die(root)
        opt.step()
        handover = store is not None and store.leaving()
        if (step + 1) % EVERY == 0 or handover:
            save(root, store, state_of(wrapped, opt, step + 1), step + 1)
        if store is not None and handover:
            store.leave()  # rank 1 raises LeftJob here; the others go on
    digest = hashlib.sha256()
    for name, value in net.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        digest.update(name.encode() + full.detach().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("kill_at", type=int)
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="fsdp2")
    parser.add_argument("--during", choices=("backward", "step"), default="backward")
    parser.add_argument("--store", choices=("disk", "peer"), default="disk")
    parser.add_argument("--leave-at", type=int, default=-1)
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("shardwire")
    notice = swt.leave_notice() if args.leave_at >= 0 else None
    store = swt.PeerStorage(leave=notice) if args.store == "peer" else None
    digest = swt.recovering(
        lambda: train(
            args.root, args.steps, args.kill_at, args.wrap, args.during, store, args.leave_at
        )
    )
    if dist.get_rank() == 0:
        print(f"final {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
