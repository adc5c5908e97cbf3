"""An arena all_gather of large parts read straight from the owners' memory
(``arena.peerread``): the oracle's results over every size and dtype, the bytes read
counted, the setting that turns it off (from the environment to the arena), the probe
that decides whether ranks may read each other, and the errors a failed read becomes."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from shardwire.protocol import CollectiveError, PeerFailed
from shardwire.worker import WorkerConfig, init
from shardwire.worker.arena import peerread
from shardwire.worker.arena.node import _read_error
from shardwire.worker.arena.programs import READ_BYTES
from shardwire.worker.backends.opening import _readers
from shardwire.worker.collectives import Group
from shardwire.worker.transport.arena_settings import ArenaSettings
from tests.worker.arena.test_arena import _nothing_left, arena_groups  # noqa: F401
from tests.worker.cluster import coordinator, worker_config
from tests.worker.collectives.worlds import on_all

ENV = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}


def _read(groups: list[Group]) -> list[int]:
    return [g.backend.gate.arena.context.read for g in groups]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
async def test_large_parts_are_read_from_their_owners_and_match_numpy(n: int, dtype: str) -> None:
    item = np.dtype(dtype).itemsize
    big = READ_BYTES // item
    async with arena_groups(n, arena_peer_reads="on") as groups:
        expected = [0] * n
        # below the threshold (through the region), at it, above it and past a slot,
        # then uneven parts with an empty one: the widest part decides, alike everywhere
        for sizes in (
            [big - 1] * n,
            [big] * n,
            [3 * big + 5] * n,
            [0, *[big + r for r in range(1, n)]],
        ):
            xs = [
                np.random.default_rng(10 * r + len(sizes)).integers(-9, 9, s).astype(dtype)
                for r, s in enumerate(sizes)
            ]
            got = await on_all(groups, lambda g: g.all_gather(xs[g.rank], sizes=sizes))
            for out in got:
                np.testing.assert_array_equal(out, np.concatenate(xs))
            if max(sizes) >= big:
                for r in range(n):
                    expected[r] += sum(s for q, s in enumerate(sizes) if q != r) * item
        assert _read(groups) == expected
        assert groups[0].backend.gate.arena.context.pids == [os.getpid()] * n


async def test_with_peer_reads_off_every_part_goes_through_the_region() -> None:
    xs = [np.full(READ_BYTES, float(r)) for r in range(2)]
    async with arena_groups(2, arena_peer_reads="off") as groups:
        got = await on_all(groups, lambda g: g.all_gather(xs[g.rank]))
        np.testing.assert_array_equal(got[1], np.concatenate(xs))
        assert _read(groups) == [0, 0]
        assert groups[0].backend.gate.arena.context.pids is None


def test_the_setting_is_read_from_the_environment_and_auto_follows_the_cpus() -> None:
    assert WorkerConfig.from_env(ENV).arena_peer_reads == "auto"
    for value in ("on", "off"):
        env = {**ENV, "SHARDWIRE_ARENA_PEER_READS": value}
        assert WorkerConfig.from_env(env).arena_peer_reads == value
    with pytest.raises(ValidationError, match="SHARDWIRE_ARENA_PEER_READS"):
        WorkerConfig.from_env({**ENV, "SHARDWIRE_ARENA_PEER_READS": "sometimes"})
    reads = {
        (setting, crowded): ArenaSettings("r", peer_reads=setting, yield_cpu=crowded).reads()
        for setting in ("auto", "on", "off")
        for crowded in (False, True)
    }
    assert [key for key, yes in reads.items() if yes] == [
        ("auto", False),
        ("on", False),
        ("on", True),
    ]


@pytest.mark.parametrize("reads", ["on", "off"])
async def test_the_setting_reaches_the_arena_of_a_job(reads: str) -> None:
    async with coordinator(2) as server:

        async def worker(i: int) -> list[int] | None:
            config = worker_config(server, 2, i, arena_peer_reads=reads)
            async with init(config) as pg:
                out = await pg.all_gather(np.full(READ_BYTES // 4, i, np.float32))
                assert out[-1] == 1.0 and out[0] == 0.0
                return pg.backend.gate.arena.context.pids

        pids = await asyncio.wait_for(asyncio.gather(worker(0), worker(1)), 60)
    assert pids == ([[os.getpid()] * 2] * 2 if reads == "on" else [None, None])


@pytest.mark.e2e
def test_a_probe_reads_the_bait_and_says_why_it_cannot() -> None:
    bait = peerread.Bait()
    assert peerread.probe(bait.offer(), 1) == ""
    wrong = {**bait.offer(), "tag": "00" * 16}
    assert peerread.probe(wrong, 1) == "local rank 1's memory read back wrong"
    assert peerread.probe({"pid": os.getpid()}, 2) == "local rank 2 offered nothing to read"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    dead = {**bait.offer(), "pid": int(gone.stdout)}  # a process that has ended
    assert "No such process" in peerread.probe(dead, 3)
    unmapped = {**bait.offer(), "at": 4096}  # the first page is never mapped
    assert "Bad address" in peerread.probe(unmapped, 3)


def test_one_rank_that_may_not_read_keeps_the_whole_group_in_the_region(caplog) -> None:
    caplog.set_level(logging.INFO, "shardwire.worker")
    bait = peerread.Bait()
    fine = {"ok": True, "reads": {**bait.offer(), "refused": ""}}
    refused = {"ok": True, "reads": {**bait.offer(), "refused": "Operation not permitted"}}
    assert _readers(bait, [{}, fine, fine], "group x") == [os.getpid()] * 3
    assert _readers(bait, [{}, fine, refused], "group x") is None
    assert _readers(bait, [{}, {"ok": True}], "group x") is None  # peer reads off there
    assert _readers(None, [{}, fine], "group x") is None  # off here
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "Operation not permitted" in said[0]
    assert "local rank 1 does not read" in said[1]


def test_a_failed_read_is_a_typed_error_naming_the_rank() -> None:
    gone = _read_error(peerread.ReadFailed(1, errno.ESRCH), 7, "all_gather:float32")
    assert isinstance(gone, PeerFailed) and gone.rank == 7
    refused = _read_error(peerread.ReadFailed(1, errno.EPERM), 7, "all_gather:float32")
    assert type(refused) is CollectiveError
    assert "rank 7" in str(refused) and "SHARDWIRE_ARENA_PEER_READS=off" in str(refused)
