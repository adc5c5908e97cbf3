"""Shared memory between worker processes: a rank killed in the middle of a large
all_reduce fails the others at once, no segment outlives the job, 32 local ranks fit a
256 MiB /dev/shm (their node arena grows with the ranks, not their pairs), and a large
all_gather reads each part from its owner's memory unless that is turned off."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardwire.worker.transport import shm
from shardwire.worker.transport.arena_settings import DEFAULT_SLOT_BYTES

from .cli import ROOT, SCRIPTS, SHARDWIRE, env
from .faults import RUN_ID, job

pytestmark = pytest.mark.e2e


def _segments_mapped(pid: int) -> int:
    prefix = shm.run_prefix(RUN_ID)
    return sum(prefix in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.timeout(300)
@pytest.mark.one_loop  # the job is the test; its loop is not
async def test_sigkill_during_a_large_shared_memory_all_reduce() -> None:
    # 4 Mi float64 = 32 MiB per all_reduce: every step moves many 1 MiB slots.
    async with job(3, STEPS="100000", SIZE=str(4 << 20)) as j:
        await j.workers[1].line(r"^step 2 ", timeout=120)
        # per rank: the world group's node arena, where the all_reduce runs; no per-pair
        # segment (offered only with a large point-to-point payload); every name gone
        for w in j.workers:
            assert _segments_mapped(w.proc.pid) == 1
        assert shm.segment_names(RUN_ID) == []
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
    assert shm.segment_names(RUN_ID) == []


@pytest.mark.timeout(300)
@pytest.mark.one_loop  # the job is the test; its loop is not
async def test_a_creator_killed_before_the_others_attach_leaves_no_name_without_an_agent():
    # Rank 1 blocks its event loop before the first collective, so the region rank 0
    # offers for the world group waits, named, for its attach; rank 0 dies right then.
    # No node agent runs here: the survivors remove the name as the job ends.
    async with job(2, STALL_RANK="1", STALL_AT="0", STALL_SECONDS="8") as j:
        await j.workers[1].line("^stalling", timeout=120)
        for _ in range(3000):  # at most 60 s: polling a directory, nothing to await
            if shm.segment_names(RUN_ID):
                break
            await asyncio.sleep(0.02)
        assert shm.segment_names(RUN_ID), "rank 0 offered no region"
        j.workers[0].signal(signal.SIGKILL)
        await j.wait(timeout=120)
    assert [w.proc.returncode for w in j.workers] == [-signal.SIGKILL, 1]
    assert shm.segment_names(RUN_ID) == []


@pytest.mark.timeout(300)
@pytest.mark.one_loop  # the job is the test; its loop is not
async def test_transport_tcp_keeps_every_byte_on_the_connections() -> None:
    async with job(2, STEPS="100000", SIZE=str(1 << 20), SHARDWIRE_TRANSPORT="tcp") as j:
        await j.workers[0].line(r"^step 2 ", timeout=120)
        assert [_segments_mapped(w.proc.pid) for w in j.workers] == [0, 0]
        assert [w.proc.returncode for w in j.workers] == [None, None]


def _private_dev_shm(size: str) -> list[str]:
    """A command prefix that runs its command with a fresh tmpfs of ``size`` on /dev/shm
    (a mount namespace of its own), or skips where one cannot be made."""
    mount = f'mount -t tmpfs -o size={size},mode=1777 shardwire /dev/shm && exec "$@"'
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    prefix = ["unshare", *user, "--mount", "--propagation", "private", "--", "sh", "-c", mount]
    probe = subprocess.run(
        [*prefix, "sh", "true"], check=False, capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()}")
    return [*prefix, "sh"]


@pytest.mark.timeout(900)
def test_thirty_two_local_ranks_fit_a_256_mib_dev_shm() -> None:
    ranks = 32
    cmd = [
        *_private_dev_shm("256m"),
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(SCRIPTS / "crowd.py"),
    ]
    result = subprocess.run(
        cmd,
        check=False,
        env=env(),
        capture_output=True,
        text=True,
        timeout=800,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert sum(" ok " in f" {line} " for line in result.stdout.splitlines()) == ranks
    assert "no node arena" not in result.stderr  # the arena formed: no fallback warning
    used = int(re.search(r"shm-used (\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert DEFAULT_SLOT_BYTES * ranks <= used <= ranks * (DEFAULT_SLOT_BYTES + (64 << 10))


def _yama_forbids_reads() -> str:
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope = path.read_text().strip() if path.exists() else "0"
    return "" if scope == "0" else f"Yama's ptrace_scope is {scope}: sibling ranks may not read"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["on", "off", "auto"])
def test_a_large_all_gather_reads_parts_from_their_owners_processes(setting: str) -> None:
    ranks = 3
    # auto reads where the node has a CPU per local rank
    reads = setting == "on" or (setting == "auto" and ranks <= len(os.sched_getaffinity(0)))
    if reads and (why := _yama_forbids_reads()):
        pytest.skip(why)
    cmd = [
        SHARDWIRE,
        "launch",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(SCRIPTS / "gather_reads.py"),
    ]
    result = subprocess.run(
        cmd,
        check=False,
        env=env(SHARDWIRE_ARENA_PEER_READS=setting),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    read = dict(re.findall(r"\bread (\d+) (\d+)$", result.stdout, re.M))
    sizes = [(1 << 18) + 1000 * q for q in range(ranks)]
    for r in range(ranks):  # three calls, each reading the other ranks' float32 parts
        expected = 3 * 4 * (sum(sizes) - sizes[r]) if reads else 0
        assert int(read[str(r)]) == expected, (r, read)
