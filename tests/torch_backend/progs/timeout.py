"""``init_process_group(timeout=...)`` bounds every collective: rank 1 arrives late and
rank 0's all_reduce fails in time, naming rank 1.

    python timeout.py SECONDS
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import shardwire.torch  # noqa: F401
from shardwire.worker import CollectiveTimeout

limit = float(sys.argv[1])
dist.init_process_group("shardwire", timeout=timedelta(seconds=limit))
t = torch.ones(4)
dist.all_reduce(t)  # everyone is in
if dist.get_rank() == 1:
    time.sleep(limit * 2.5)
    raise SystemExit(0)
start = time.monotonic()
try:
    dist.all_reduce(t)
except CollectiveTimeout as exc:
    print(f"timed out after {time.monotonic() - start:.1f} s: {str(exc).splitlines()[0]}")
    raise SystemExit(3) from None
raise SystemExit("the late rank's all_reduce returned")
