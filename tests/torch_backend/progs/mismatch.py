"""Rank 0 all-reduces 4 elements, the others 5: shardwire's mismatch check names it."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwire.torch  # noqa: F401
from shardwire.worker import CollectiveMismatch

dist.init_process_group("shardwire")
t = torch.ones(4 if dist.get_rank() == 0 else 5)
try:
    dist.all_reduce(t)
except CollectiveMismatch as exc:
    print("mismatch:", str(exc).splitlines()[0], flush=True)
    raise SystemExit(3) from None
raise SystemExit("mismatched all_reduce returned")
