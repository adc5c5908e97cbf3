"""Training that goes on through a rank's death in its processes (live recovery).

    shardwire launch --standalone --nproc-per-node 4 --max-restarts 1 --recovery live \
        reform.py DIR STEPS KILL_AT [--wrap ddp|fsdp2] [--during backward|step] \
            [--store disk|peer|both|heal] [--leave-at STEP] [--lose-node NODE:STEP]

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
loads the newest checkpoint (``PeerStorage.latest()`` for ``peer``). ``heal`` (DDP)
saves nothing: each rank keeps its model, optimizer and step from the failed attempt,
and ``shardwire.torch.heal`` sends the newest a survivor holds to the replacement. With
``--leave-at STEP`` (``peer`` only) rank 1 is sent SIGTERM instead, as it starts step
STEP, with a notice to leave armed: every rank saves at the end of that step and rank 1
leaves with ``LeftJob``; everyone goes on from that step. With ``--lose-node NODE:STEP``
(under ``shardwire worker``, node ids as ``--node-id``) the first rank of node NODE
kills its node's agent and itself in step STEP, so the node's ranks are gone at once.
``both`` saves in the ranks' memory and under DIR at every checkpoint; a rank that
restores from memory then also loads the file-system checkpoint of the same step, in
the same world, into another model and optimizer, and checks that the two states are
the same bit for bit (the oracle of a load at another world size: DCP's resharding of
the same bytes). Each rank prints its process id whenever ``train`` starts; rank 0
prints the digest of the final parameters.
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


def lose_node(root: Path) -> None:
    """This node's agent and this rank, at once (once: a file in DIR marks it)."""
    marker = root / "node-lost"
    if not marker.exists():
        marker.write_text("")
        os.kill(agent_pid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def agent_pid() -> int:
    """This rank's node agent: its parent, or its fork server's parent if forked."""
    parent = os.getppid()
    if b"launcher.forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes():
        return int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return parent


def state_of(wrapped: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(wrapped, opt)
    return {"model": model_state, "optim": optim_state, "step": step}


def tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state dict, whole, by its dotted path."""
    if isinstance(state, dict):
        found: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            found |= tensors(value, f"{prefix}.{key}")
        return found
    if isinstance(state, DTensor):
        return {prefix: state.full_tensor()}
    return {prefix: state} if isinstance(state, torch.Tensor) else {}


def same_as_disk(root: Path, state: dict[str, Any], wrap: str) -> None:
    """The state restored from memory is what the file-system checkpoint of its step
    gives, loaded in this world into another model and optimizer."""
    step = int(state["step"])
    other, _ = model(wrap)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.01)
    disk = state_of(other, other_opt, 0)
    dcp.load(disk, checkpoint_id=str(root / f"step-{step}"))
    mine, theirs = tensors(state), tensors(disk)
    assert mine.keys() == theirs.keys(), (sorted(mine), sorted(theirs))
    unequal = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not unequal, f"restored from memory unlike the disk checkpoint: {unequal}"
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} restored step {step} in a world of {world} as on disk", flush=True)


def restore(
    root: Path,
    store: swt.PeerStorage | None,
    wrapped: nn.Module,
    opt: torch.optim.Optimizer,
    verify: str | None = None,
) -> int:
    """Load the newest checkpoint into the model and optimizer: its step (0: none).
    The state dict is only asked for when there is one to load: asking initialises the
    optimizer's state (a step of AdamW's count), which a fresh start must not do.
    ``verify`` (the wrapping): check a load from memory against the disk's."""
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
    if verify is not None and store is not None:
        same_as_disk(root, state, verify)
    set_state_dict(wrapped, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"]) if start < 0 else start


def save(
    root: Path, store: swt.PeerStorage | None, state: dict[str, Any], step: int, disk: bool
) -> None:
    if store is not None:
        dcp.save(state, checkpoint_id=f"step-{step}", storage_writer=store)
    if not disk:
        return
    where = root / f"step-{step}"
    dcp.save(state, checkpoint_id=str(where))
    dist.barrier()
    if dist.get_rank() == 0:
        (where / "done").write_text("")


class Held:
    """This process's model, optimizer and step from its last attempt (``heal``); the
    step counts the optimizer steps taken, at once after each."""

    wrapped: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    step = 0


def healed(wrapped: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The newest state a live rank holds, into this attempt's model and optimizer: its
    step (0: no rank holds one)."""
    old = state_of(Held.wrapped, Held.opt, Held.step) if Held.opt is not None else None
    got, step = swt.heal(old, Held.step)
    if got is not None:
        set_state_dict(wrapped, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    Held.wrapped, Held.opt, Held.step = wrapped, opt, step
    return step


def train(
    root: Path,
    steps: int,
    kill_at: int,
    wrap: str,
    during: str,
    store: swt.PeerStorage | None,
    leave_at: int = -1,
    *,
    disk: bool = False,
    lose: tuple[str, int] | None = None,
    heal: bool = False,
) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} pid {os.getpid()} trains", flush=True)
    wrapped, net = model(wrap)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
    if heal:
        start = healed(wrapped, opt)
    else:
        start = restore(root, store, wrapped, opt, wrap if disk and store is not None else None)
    first_of_lost = lose is not None and (
        os.environ.get("SHARDWIRE_NODE_ID") == lose[0] and os.environ.get("LOCAL_RANK") == "0"
    )
    if start:
        print(f"rank {rank} resumes at step {start}", flush=True)
    for step in range(start, steps):
        armed = step == kill_at and rank == 1
        net.fire = (lambda: die(root)) if armed and during == "backward" else (lambda: None)
        if step == leave_at and rank == 1 and not (root / "left").exists():
            (root / "left").write_text("")
            os.kill(os.getpid(), signal.SIGTERM)
        if first_of_lost and lose is not None and step == lose[1]:
            lose_node(root)
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
        Held.step = step + 1
        handover = store is not None and store.leaving()
        if (step + 1) % EVERY == 0 or handover:
            save(root, store, state_of(wrapped, opt, step + 1), step + 1, disk)
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
    parser.add_argument("--store", choices=("disk", "peer", "both", "heal"), default="disk")
    parser.add_argument("--leave-at", type=int, default=-1)
    parser.add_argument("--lose-node", default=None, help="NODE:STEP")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("shardwire")
    notice = swt.leave_notice() if args.leave_at >= 0 else None
    store = swt.PeerStorage(leave=notice) if args.store in ("peer", "both") else None
    lose = None
    if args.lose_node is not None:
        node, at = args.lose_node.rsplit(":", 1)
        lose = (node, int(at))
    digest = swt.recovering(
        lambda: train(
            args.root,
            args.steps,
            args.kill_at,
            args.wrap,
            args.during,
            store,
            args.leave_at,
            disk=args.store in ("disk", "both"),
            lose=lose,
            heal=args.store == "heal",
        )
    )
    if dist.get_rank() == 0:
        print(f"final {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
