"""Shared memory between worker processes: a rank killed in the middle of a large
all_reduce fails the others at once, and no segment outlives the job."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from shardwire.worker.transport import shm

from .faults import job


def _segments_mapped(pid: int) -> int:
    prefix = shm.run_prefix("faults")
    return sum(prefix in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.timeout(300)
async def test_sigkill_during_a_large_shared_memory_all_reduce() -> None:
    # 4 Mi float64 = 32 MiB per all_reduce: every step moves many 1 MiB slots.
    async with job(3, STEPS="100000", SIZE=str(4 << 20)) as j:
        await j.workers[1].line(r"^step 2 ", timeout=120)
        # per rank: the world group's node arena (where the all_reduce runs), and two
        # per-pair segments out and two in; every name already gone
        for w in j.workers:
            assert _segments_mapped(w.proc.pid) == 5
        assert shm.segment_names("faults") == []
        j.workers[1].signal(signal.SIGKILL)
        struck = time.monotonic()
        await j.wait([0, 2], timeout=60)
        for w in (j.workers[0], j.workers[2]):
            assert w.proc.returncode == 1
            # Each survivor names rank 1, also when it hears first from the other
            # survivor: that one hangs up without a reset, so its notice is read.
            assert re.search(r"stopped: rank 1 failed", "\n".join(w.err)), w.err
            assert w.exited_at is not None and w.exited_at - struck < 3.0
    failure = j.server.rendezvous.failure
    assert failure is not None and failure.rank == 1
    assert shm.segment_names("faults") == []


@pytest.mark.timeout(300)
async def test_transport_tcp_keeps_every_byte_on_the_connections() -> None:
    async with job(2, STEPS="100000", SIZE=str(1 << 20), SHARDWIRE_TRANSPORT="tcp") as j:
        await j.workers[0].line(r"^step 2 ", timeout=120)
        assert [_segments_mapped(w.proc.pid) for w in j.workers] == [0, 0]
        assert [w.proc.returncode for w in j.workers] == [None, None]
