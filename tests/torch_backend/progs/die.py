"""Rank 1 kills itself (SIGKILL) in the middle of a run of all_reduces."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

import shardwire.torch  # noqa: F401

dist.init_process_group("shardwire")
t = torch.ones(4096)
for step in range(20):
    if step == 3 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
raise SystemExit("all_reduce returned after a rank died")
