"""The end-to-end baseline: the charlm model shape trained with PyTorch FSDP2
(``fully_shard``) over gloo, the way ``examples/charlm.py`` trains it with shardwire.

Run with an interpreter that has torch; this file imports nothing from shardwire:

    python fsdp2.py OUT.json '{"n": 2, "steps": 40, "batch": 32, "context": 64, ...}'

It starts ``n`` ranks on loopback, and rank 0 writes ``{"tokens_per_s": ...}``, counted
like charlm's: the whole loop (forward, backward, gradient clipping, AdamW step, the
loss all-reduce and the stop flag), over every step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(torch, vocab: int, cfg: dict):
    nn, F = torch.nn, torch.nn.functional
    dim, heads, context = cfg["dim"], cfg["heads"], cfg["context"]

    class Block(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class LM(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return LM()


def _rank(cfg: dict, rank: int, port: int, out: str) -> None:
    import pydoc_data.topics

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    n = cfg["n"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    topics = pydoc_data.topics.topics
    text = "".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = np.array([index[c] for c in text], np.int64)[: int(len(text) * 0.9)]
    torch.manual_seed(cfg["seed"])
    model = _model(torch, len(chars), cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    draw = np.random.default_rng(cfg["seed"] + 1)
    mine = np.array_split(np.arange(cfg["batch"]), n)[rank]
    context = cfg["context"]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(cfg["steps"]):
        starts = draw.integers(0, len(data) - context - 1, cfg["batch"])[mine]
        rows = torch.from_numpy(data[starts[:, None] + np.arange(context + 1)])
        ids, targets = rows[:, :-1], rows[:, 1:]
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        float(total.item())
        stop = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(stop)
    elapsed = time.perf_counter() - start
    if rank == 0:
        tokens = cfg["steps"] * cfg["batch"] * context
        with open(out, "w") as f:
            json.dump({"tokens_per_s": tokens / elapsed, "time_s": elapsed}, f)
    dist.destroy_process_group()


def main() -> None:
    out, cfg = sys.argv[1], json.loads(sys.argv[2])
    if "rank" in cfg:
        _rank(cfg, cfg["rank"], cfg["port"], out)
        return
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(  # noqa: S603 (this interpreter, this file)
            [sys.executable, __file__, out, json.dumps({**cfg, "rank": r, "port": port})],
            env=env,
        )
        for r in range(cfg["n"])
    ]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"FSDP2 ranks exited with {codes}")


if __name__ == "__main__":
    main()
