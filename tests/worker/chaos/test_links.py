"""Network faults in front of a rank's own transport: what each does to the messages it
sends, measured on real transports."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shardwire.protocol import IntegrityError, PeerFailed, Tag, Token
from shardwire.worker.chaos.links import LinkFaults
from shardwire.worker.chaos.plan import Fault
from shardwire.worker.transport import MeshConfig, TcpMesh
from tests.isolation import RUN_ID
from tests.worker.transport.fabric import memory_world, tcp_world

TAG = Tag(0, 1, 0)
LATER = Tag(0, 2, 0)


def _fault(kind: str, **kw: object) -> Fault:
    return Fault(kind=kind, rank=0, step=0, **kw)  # type: ignore[arg-type]


async def _timed_send(world, array: np.ndarray, tag: Tag = TAG) -> float:
    sender, receiver = world
    start = time.monotonic()
    got, _ = await asyncio.gather(
        receiver.recv(0, tag=tag, timeout=30), sender.send(1, array, tag=tag, timeout=30)
    )
    np.testing.assert_array_equal(got, array)
    return time.monotonic() - start


async def test_a_delay_holds_every_message_to_its_peer_only() -> None:
    async with memory_world(3) as world:
        faults = LinkFaults(world[0], seed=0)
        faults.start(_fault("delay", delay_s=0.3, for_s=5.0, peer=1))
        assert await _timed_send(world[:2], np.ones(4)) >= 0.3
        start = time.monotonic()
        await asyncio.gather(
            world[2].recv(0, tag=TAG, timeout=30), world[0].send(2, np.ones(4), tag=TAG, timeout=30)
        )
        assert time.monotonic() - start < 0.25  # rank 2's link is not delayed


async def test_a_throttle_takes_the_time_the_bytes_take_at_the_rate() -> None:
    async with memory_world(2) as world:
        LinkFaults(world[0], seed=0).start(_fault("throttle", rate_mbps=8.0, for_s=30.0))
        elapsed = await _timed_send(world, np.zeros(100_000, np.uint8))  # 0.8 Mbit at 8 Mbit/s
        assert 0.1 <= elapsed < 5.0


async def test_a_blackhole_holds_messages_until_it_closes_then_delivers() -> None:
    async with memory_world(2) as world:
        faults = LinkFaults(world[0], seed=0)
        faults.start(_fault("blackhole", for_s=0.5))
        assert await _timed_send(world, np.arange(3.0)) >= 0.45
        assert await _timed_send(world, np.arange(3.0), Tag(0, 2, 0)) < 0.4  # it closed


async def test_a_window_ends() -> None:
    async with memory_world(2) as world:
        LinkFaults(world[0], seed=0).start(_fault("delay", delay_s=0.5, for_s=0.05))
        await asyncio.sleep(0.1)
        assert await _timed_send(world, np.ones(2)) < 0.4


async def test_a_flipped_byte_is_caught_by_the_receiver() -> None:
    async with tcp_world(2) as world:
        LinkFaults(world[0], seed=3).start(_fault("flip", peer=1))
        payload = np.arange(1000, dtype=np.float64)
        await _timed_send(world, np.ones(4))  # small: it goes as it is
        with pytest.raises(IntegrityError):
            await asyncio.gather(
                world[1].recv(0, tag=LATER, timeout=10),
                world[0].send(1, payload, tag=LATER, timeout=10),
            )
        assert payload.tolist() == list(range(1000))  # the caller's array is untouched


async def test_a_reset_breaks_the_connection_for_both_ends() -> None:
    async with tcp_world(2) as world:
        await _timed_send(world, np.ones(4))  # the connection is up
        LinkFaults(world[0], seed=0).start(_fault("reset", peer=1))
        with pytest.raises(PeerFailed):
            await world[1].recv(0, tag=Tag(0, 2, 0), timeout=10)


def test_shm_fill_fills_to_the_percent_with_a_file_of_the_run() -> None:
    import os

    from shardwire.worker.chaos.inject import fill_shm
    from shardwire.worker.transport.shmfiles import SHM_DIR, segment_names

    stats = os.statvfs(SHM_DIR)
    total = stats.f_blocks * stats.f_frsize
    used = total - stats.f_bavail * stats.f_frsize
    target = min(99.0, 100 * used / total + 0.5)  # half a percent more than now
    run = TcpMesh(MeshConfig(run_id=RUN_ID, token=Token("t")))  # only its run id is read
    before = set(segment_names(RUN_ID))
    taken = fill_shm(run, target)
    (made,) = set(segment_names(RUN_ID)) - before
    try:
        assert made.stat().st_size == taken > 0
        assert abs(taken - (total * target / 100 - used)) < total / 100
    finally:
        made.unlink()


def test_a_slow_disk_holds_each_checkpoint_file_while_it_lasts(tmp_path) -> None:
    from shardwire.worker.fsdp.store import SlowDisk, write_rank_file

    tensors = {"w": np.arange(8.0)}
    try:
        SlowDisk.delay_s, SlowDisk.until = 0.3, time.monotonic() + 30
        start = time.monotonic()
        write_rank_file(tmp_path / "a", 0, tensors, "n")
        assert time.monotonic() - start >= 0.3
        SlowDisk.until = time.monotonic()  # over
        start = time.monotonic()
        write_rank_file(tmp_path / "b", 0, tensors, "n")
        assert time.monotonic() - start < 0.25
    finally:
        SlowDisk.delay_s, SlowDisk.until = 0.0, 0.0
