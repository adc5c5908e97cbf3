"""Every torch-facing way to learn a call failed, after rank 1 kills itself (SIGKILL).

The survivors start async calls that rank 1 never joins and read each failure one way:
``wait()``, ``wait(timeout)``, ``exception()``, ``get_future().wait()``, a callback
chained with ``then``, ``torch.futures.collect_all`` (a C++ reader of the future) and a
blocking collective. Each prints ``ok WAY: ERROR`` with what it raised or saw.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwire.protocol import PeerFailed
from shardwire.torch import BridgeWork

dist.init_process_group("shardwire")
dist.barrier()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)


def start() -> BridgeWork:
    work = dist.all_reduce(torch.ones(1024), async_op=True)
    assert isinstance(work, BridgeWork), type(work)
    return work


def say(way: str, error: BaseException) -> None:
    text = str(error).splitlines()[0]
    print(f"ok {way}: {type(error).__name__}: {text}", flush=True)


waited, timed, probed, future, chained, collected = (start() for _ in range(6))
try:
    waited.wait()
except PeerFailed as error:
    say("wait", error)
try:
    timed.wait(timedelta(seconds=120))
except PeerFailed as error:
    say("wait(timeout)", error)
try:
    probed.wait()
except PeerFailed:
    pass
assert probed.is_completed() and not probed.is_success()
say("exception", probed.exception())
try:
    future.get_future().wait()
except RuntimeError as error:
    say("get_future", error)
seen: list[BaseException] = []


def callback(fut: torch.futures.Future) -> None:
    try:
        fut.value()
    except RuntimeError as error:
        seen.append(error)
        raise


try:
    chained.get_future().then(callback).wait()
except RuntimeError:
    say("then", seen[0])
try:
    torch.futures.collect_all([collected.get_future()]).wait()[0].wait()
except RuntimeError as error:
    say("collect_all", error)
try:
    dist.all_reduce(torch.ones(4))
except PeerFailed as error:
    say("blocking", error)
raise SystemExit(3)
