"""The charlm model (a character-level transformer on CPython's ``pydoc_data.topics``)
in PyTorch, sharded with FSDP2 (``fully_shard``) over the shardwire backend.

    shardwire launch --standalone --nproc-per-node 4 examples/torch_charlm.py

It runs the same way under torchrun, and ``--backend gloo`` trains the identical run over
torch's gloo for comparison. The loop is charlm's: forward, backward, gradient clipping
at 1.0, AdamW, the loss all-reduced every step. Rank 0 prints tokens/s (every step
counted) and the held-out loss in nats per character, and with ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import shardwire.torch  # noqa: F401  (registers the "shardwire" backend)


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


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    data, vocab = corpus()
    cut = int(len(data) * 0.9)
    train, held = data[:cut], data[cut:]
    torch.manual_seed(args.seed)
    model = LM(vocab, dim=args.dim, heads=args.heads, layers=args.layers, context=args.context)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    draw = np.random.default_rng(args.seed + 1)
    mine = np.array_split(np.arange(args.batch), size)[rank]
    dist.barrier()
    start = time.perf_counter()
    loss = torch.zeros(1)
    for _ in range(args.steps):
        starts = draw.integers(0, len(train) - args.context - 1, args.batch)[mine]
        part = loss_of(model, *windows(train, starts, args.context)) * (len(mine) / args.batch)
        opt.zero_grad()
        (part * size).backward()  # FSDP2 averages gradients over the ranks
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = part.detach().clone()
        dist.all_reduce(loss)
    elapsed = time.perf_counter() - start
    summary = {
        "backend": args.backend,
        "ranks": size,
        "steps": args.steps,
        "train_loss": round(float(loss), 4),
        "held_out_nats_per_char": round(held_out(model, held, args.context, rank, size), 4),
        "tokens_per_s": round(args.steps * args.batch * args.context / elapsed),
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f)
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
    p.add_argument("--json", help="rank 0 writes its summary here")
    return p.parse_args()


if __name__ == "__main__":
    main(parse())
