"""The charlm model (a character-level transformer on CPython's ``pydoc_data.topics``)
in PyTorch, sharded with FSDP2 (``fully_shard``, or ``--wrap ddp``) over the shardwire
backend.

    shardwire launch --standalone --nproc-per-node 4 examples/torch_charlm.py

It runs the same way under torchrun, and ``--backend gloo`` trains the identical run over
torch's gloo for comparison. The loop is charlm's: forward, backward, gradient clipping
at 1.0, AdamW, the loss all-reduced every step; step s reads the batch drawn from the
seed and s, so a run resumed at any step reads what it would have. Rank 0 prints
tokens/s (every step counted) and the held-out loss in nats per character, and with
``--json`` (or ``--run-dir``, as ``summary.json``) writes them.

Through failures: ``--checkpoint-dir`` with ``--save-every`` keeps a
``torch.distributed.checkpoint`` on disk, from which a relaunched job resumes; under
``shardwire launch --recovery live`` ``--copy-every`` keeps one in the ranks' memory
(``shardwire.torch.PeerStorage``) from which the survivors and the failed rank's
replacement resume in their processes, and SIGTERM hands the rank's part over before
it leaves. Under DDP a live job needs no copy: every survivor holds the whole state at
its newest step, and the replacement takes it from one (``shardwire.torch.heal``), so
no step is done twice. Every step is told to shardwire (``shardwire.torch.step_finished``): the
status views show it, and ``shardwire chaos`` checks its invariants.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import shardwire.torch as swt  # registers the "shardwire" backend


def corpus() -> tuple[np.ndarray, int]:
    import pydoc_data.topics

    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return np.array([index[c] for c in text], np.int64), len(chars)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class LM(nn.Module):
    def __init__(self, vocab: int, *, dim: int, heads: int, layers: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def windows(data: np.ndarray, starts: np.ndarray, context: int) -> tuple[torch.Tensor, ...]:
    rows = torch.from_numpy(data[starts[:, None] + np.arange(context + 1)])
    return rows[:, :-1], rows[:, 1:]


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def held_out(model: nn.Module, data: np.ndarray, context: int, rank: int, size: int) -> float:
    starts = np.arange(64) * ((len(data) - context - 1) // 64)
    mine = np.array_split(starts, size)[rank]
    total = torch.zeros(1, dtype=torch.float64)
    if len(mine):
        total += float(loss_of(model, *windows(data, mine, context))) * len(mine)
    dist.all_reduce(total)
    return float(total) / len(starts)


def build(args: argparse.Namespace, vocab: int) -> nn.Module:
    torch.manual_seed(args.seed)
    model = LM(vocab, dim=args.dim, heads=args.heads, layers=args.layers, context=args.context)
    if args.wrap == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state, "step": step}


def newest_on_disk(root: Path | None) -> Path | None:
    if root is None:
        return None
    done = [p for p in root.glob("step-*") if (p / "done").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


class Held:
    """This process's model, optimizer and step from its last attempt (DDP under live
    recovery); the step counts optimizer steps, set at once after each."""

    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    step = 0


def healed(args, model, opt) -> int:
    """DDP under live recovery: the newest state a live rank holds (a survivor's, after
    a failure), into this attempt's model and optimizer: its step (0: none holds one)."""
    if args.wrap != "ddp" or args.backend != "shardwire" or not swt.bridge.live:
        return 0
    old = state_of(Held.model, Held.opt, Held.step) if Held.opt is not None else None
    got, step = swt.heal(old, Held.step)
    if got is not None:
        set_state_dict(model, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    Held.model, Held.opt, Held.step = model, opt, step
    return step


def resume(args, model, opt, store) -> int:
    """Restore the newest state: a live rank's (DDP), else the newest checkpoint in the
    peers' memory, else on disk. Its step."""
    if live := healed(args, model, opt):
        return live
    found = store.latest() if store is not None else None
    reader = store
    if found is None and (on_disk := newest_on_disk(args.checkpoint_dir)) is not None:
        found, reader = str(on_disk), None
    if found is None:
        return 0
    state = state_of(model, opt, 0)
    dcp.load(state, checkpoint_id=found, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def save(args, model, opt, store, step: int, *, handover: bool) -> None:
    if store is not None and (handover or step % args.copy_every == 0):
        dcp.save(state_of(model, opt, step), checkpoint_id=f"step-{step}", storage_writer=store)
        if handover:
            store.leave()  # a rank told to leave (SIGTERM) ends here; the others go on
    if args.checkpoint_dir is not None and args.save_every and step % args.save_every == 0:
        where = args.checkpoint_dir / f"step-{step}"
        dcp.save(state_of(model, opt, step), checkpoint_id=str(where))
        dist.barrier()
        if dist.get_rank() == 0:
            (where / "done").write_text("")


def out_of_time(start: float, minutes: float) -> bool:
    """Whether ``minutes`` have passed since ``start`` on any rank: every rank stops
    after the same step (a rank deciding on its own clock would leave the others
    waiting in a step it never joins)."""
    late = torch.tensor([int(time.perf_counter() - start >= minutes * 60)])
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def train(args, data: np.ndarray, vocab: int, store) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    cut = int(len(data) * 0.9)
    train_data, held = data[:cut], data[cut:]
    model = build(args, vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    first = resume(args, model, opt, store)
    mine = np.array_split(np.arange(args.batch), size)[rank]
    dist.barrier()
    start = time.perf_counter()
    loss = torch.zeros(1)
    step = first
    while step < args.steps and not out_of_time(start, args.minutes):
        draw = np.random.default_rng([args.seed + 1, step])
        starts = draw.integers(0, len(train_data) - args.context - 1, args.batch)[mine]
        part = loss_of(model, *windows(train_data, starts, args.context))
        part = part * (len(mine) / args.batch)
        opt.zero_grad()
        (part * size).backward()  # DDP and FSDP2 average gradients over the ranks
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        Held.step = step
        loss = part.detach().clone()
        dist.all_reduce(loss)
        swt.step_finished(
            step,
            read=starts,
            model=model,
            loss=float(loss),
            samples=len(mine),
            total_steps=args.steps,
        )
        handover = store is not None and store.leaving()
        save(args, model, opt, store, step, handover=handover)
    elapsed = time.perf_counter() - start
    return {
        "backend": args.backend,
        "wrap": args.wrap,
        "ranks": size,
        "steps": step,
        "train_loss": round(float(loss), 4),
        "held_out_nats_per_char": round(held_out(model, held, args.context, rank, size), 4),
        "tokens_per_s": round((step - first) * args.batch * args.context / elapsed),
    }


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    data, vocab = corpus()
    store = None
    if args.copy_every and args.backend == "shardwire":
        notice = swt.leave_notice() if swt.bridge.live and dist.get_world_size() > 1 else None
        store = swt.PeerStorage(leave=notice)
    summary = swt.recovering(lambda: train(args, data, vocab, store))
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)
        for path in (args.json, args.run_dir and Path(args.run_dir) / "summary.json"):
            if path:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(json.dumps(summary))
    dist.barrier()  # every rank tears down together
    dist.destroy_process_group()
    if args.backend == "gloo":
        # gloo's group on the store's host aborts in a C++ destructor at interpreter
        # exit now and then ("terminate called without an active exception") after a
        # clean teardown; its work is done and its output flushed, so it leaves at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="shardwire", help="torch.distributed backend")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wrap",
        choices=("fsdp2", "ddp"),
        default="fsdp2",
        help="how the model is spread over the ranks: FSDP2's fully_shard, or DDP",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=float("inf"),
        help="stop after this long, at most --steps steps",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="a torch.distributed.checkpoint on "
        "disk every --save-every steps; a relaunched job resumes from it",
    )
    p.add_argument("--save-every", type=int, default=0, help="steps between disk checkpoints")
    p.add_argument(
        "--copy-every",
        type=int,
        default=0,
        help="steps between checkpoints in the ranks' memory (PeerStorage, live recovery; 0: none)",
    )
    p.add_argument("--run-dir", help="rank 0 writes summary.json here")
    p.add_argument("--json", help="rank 0 writes its summary here")
    return p.parse_args()


if __name__ == "__main__":
    main(parse())
