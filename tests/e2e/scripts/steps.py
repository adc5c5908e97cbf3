"""Test script: every rank all-reduces once per step and prints ``step N VALUE``.

Faults, chosen by environment variables:
  STALL_RANK, STALL_AT, STALL_MODE (sleep | numpy), STALL_SECONDS: that rank blocks its
      event loop before step STALL_AT (in ``nap`` or ``crunch``);
  SKIP_RANK, SKIP_AT: that rank skips the all_reduce of step SKIP_AT and waits in
      ``dawdle`` instead.
SLOW_RANK, SLOW_SECONDS: that rank does SLOW_SECONDS of other work (asleep) before every
    all_reduce, so the others wait for it each time.
SIZE: elements of each all_reduce (default 1; the first one carries the step value).
TERM_DELAY: seconds a SIGTERM takes to end the process (a slow shutdown).
Every rank first prints ``listening PORT pid PID`` (its peer listener); at the end
``done TOTAL`` (the sum of all its all_reduce results), and with SHOW_NOFILE ``nofile
LIMIT`` (its open-file limit then).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time

import numpy as np

import shardwire.worker as sw


def _int(name: str, default: int = -1) -> int:
    return int(os.environ.get(name, default))


def nap(seconds: float) -> None:
    time.sleep(seconds)  # marker: nap-sleep


def crunch(seconds: float) -> None:
    a = np.full((64, 64), 0.5)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = np.tanh(a @ a)


async def dawdle(seconds: float) -> None:
    await asyncio.sleep(seconds)  # marker: dawdle-await


def _slow_exit(_signum: int, _frame: object) -> None:
    time.sleep(float(os.environ["TERM_DELAY"]))
    os._exit(128 + signal.SIGTERM)


async def main() -> None:
    if os.environ.get("TERM_DELAY"):
        signal.signal(signal.SIGTERM, _slow_exit)
    steps, delay = _int("STEPS", 20), float(os.environ.get("STEP_DELAY", "0"))
    stall_rank, stall_at = _int("STALL_RANK"), _int("STALL_AT")
    skip_rank, skip_at = _int("SKIP_RANK"), _int("SKIP_AT")
    seconds = float(os.environ.get("STALL_SECONDS", "0"))
    size = _int("SIZE", 1)
    slow_rank, slow = _int("SLOW_RANK"), float(os.environ.get("SLOW_SECONDS", "0"))
    total = 0.0
    async with sw.init() as pg:
        print(f"listening {pg.transport.listen_port} pid {os.getpid()}", flush=True)
        for step in range(steps):
            if pg.rank == stall_rank and step == stall_at:
                print("stalling", flush=True)
                (crunch if os.environ.get("STALL_MODE") == "numpy" else nap)(seconds)
            if pg.rank == skip_rank and step == skip_at:
                print("skipping", flush=True)
                await dawdle(120)
            if pg.rank == slow_rank:
                await asyncio.sleep(slow)
            x = await pg.all_reduce(np.full(size, float(step + pg.rank)))
            total += float(x[0])
            print(f"step {step} {x[0]:g}", flush=True)
            pg.report_progress(step)  # a chaos plan's step faults fire here
            if delay:
                await asyncio.sleep(delay)
        print(f"done {total:g}", flush=True)
        if os.environ.get("SHOW_NOFILE"):
            print(f"nofile {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}", flush=True)


if __name__ == "__main__":
    sw.run(main())
