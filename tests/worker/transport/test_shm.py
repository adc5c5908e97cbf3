"""The shared-memory data path: offered per same-node direction with its first large
payload, byte-exact, bounded by its slots, refused when the segment cannot be attached,
and leaving nothing in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from shardwire.protocol import FrameKind, PeerFailed, ProtocolError, Tag, encode_head
from shardwire.worker.kernels.procstat import stat_fields
from shardwire.worker.transport import shm
from shardwire.worker.transport.shmlink import CHUNK_KEY, CREDIT_KEY, SHM_KEY, SHM_MIN_BYTES
from tests.isolation import RUN_ID

from .fabric import mixed_world, shm_world, tcp_world


def mapped_segments(run_id: str = RUN_ID) -> list[str]:
    prefix = shm.run_prefix(run_id)
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if prefix in line]


async def touch(meshes, nbytes: int = SHM_MIN_BYTES) -> None:
    """Every rank sends ``nbytes`` to every other (each direction's first large payload)."""
    n, x = len(meshes), np.ones(nbytes, dtype=np.uint8)
    sends = [meshes[r].send(p, x, tag=Tag(7, 0)) for r in range(n) for p in range(n) if p != r]
    recvs = [meshes[r].recv(p, tag=Tag(7, 0)) for r in range(n) for p in range(n) if p != r]
    for got in (await asyncio.gather(*sends, *recvs))[len(sends) :]:
        np.testing.assert_array_equal(got, x)


@pytest.fixture(autouse=True)
def _no_segments_left():
    yield
    assert shm.segment_names(RUN_ID) == []
    assert mapped_segments() == []


async def test_same_node_pairs_send_through_shared_memory_byte_exact() -> None:
    async with shm_world(3, shm_slots=3, shm_slot_bytes=64 << 10) as meshes:
        assert [m.shm_peers() for m in meshes] == [[], [], []]  # nothing until needed
        assert mapped_segments() == []
        await touch(meshes, SHM_MIN_BYTES - 1)  # small payloads stay on the connection
        assert mapped_segments() == []
        await touch(meshes)  # every direction offers at once: answers never queue behind
        assert [m.shm_peers() for m in meshes] == [[1, 2], [0, 2], [0, 1]]
        assert shm.segment_names(RUN_ID) == []  # names dropped once attached
        assert len(mapped_segments()) == 6 * 2  # each direction, mapped at both ends
        rng = np.random.default_rng(0)
        sizes = [1, SHM_MIN_BYTES - 1, SHM_MIN_BYTES, (5 << 20) + 12345, 64 << 10]
        for i, size in enumerate(sizes):
            data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(3)]

            async def exchange(r: int) -> list[np.ndarray]:
                m = meshes[r]
                peers = [p for p in range(3) if p != r]
                sends = [m.send(p, data[r], tag=Tag(1, i)) for p in peers]
                recvs = [m.recv(p, tag=Tag(1, i)) for p in peers]
                got = await asyncio.gather(*sends, *recvs)
                return got[len(peers) :]

            results = await asyncio.gather(*(exchange(r) for r in range(3)))
            for r, got in enumerate(results):
                peers = [p for p in range(3) if p != r]
                for p, array in zip(peers, got, strict=True):
                    np.testing.assert_array_equal(array, data[p])
    assert mapped_segments() == []


async def test_nodes_use_shared_memory_inside_and_tcp_across() -> None:
    async with mixed_world(4) as meshes:
        await touch(meshes)
        assert [m.shm_peers() for m in meshes] == [[1], [0], [3], [2]]


async def test_tcp_only_when_shared_memory_is_off() -> None:
    async with tcp_world(2) as meshes:
        await touch(meshes)
        assert [m.shm_peers() for m in meshes] == [[], []]


async def test_a_segment_that_cannot_be_attached_leaves_the_pair_on_tcp(monkeypatch) -> None:
    def elsewhere(*args, **kwargs):
        raise FileNotFoundError("no such segment (a separate /dev/shm)")

    monkeypatch.setattr(shm.Segment, "attach", elsewhere)
    async with shm_world(2) as (a, b):
        x = np.arange(1 << 20, dtype=np.float32)
        for i in range(2):  # the refusal holds: no second offer
            got = await asyncio.gather(a.send(1, x, tag=Tag(1, i)), b.recv(0, tag=Tag(1, i)))
            np.testing.assert_array_equal(got[1], x)
        assert a.shm_peers() == [] and b.shm_peers() == []


async def test_a_full_dev_shm_leaves_the_pair_on_tcp(monkeypatch) -> None:
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.Segment, "create", full)
    async with shm_world(2) as (a, b):
        await touch([a, b])
        assert a.shm_peers() == [] and b.shm_peers() == []


def test_attach_refuses_a_foreign_name_a_wrong_nonce_and_an_open_mode(tmp_path: Path) -> None:
    segment, nonce = shm.Segment.create("test", 2, 4096, directory=tmp_path)
    name = segment.path.name
    try:
        assert (segment.path.stat().st_mode & 0o777) == 0o600
        with pytest.raises(ProtocolError, match="not one of this run"):
            shm.Segment.attach(
                "other", name, slots=2, slot_bytes=4096, nonce=nonce, directory=tmp_path
            )
        with pytest.raises(ProtocolError, match="not one of this run"):
            shm.Segment.attach(
                "test", "../" + name, slots=2, slot_bytes=4096, nonce=nonce, directory=tmp_path
            )
        with pytest.raises(ProtocolError, match=r"not the one offered \(nonce differs\)"):
            shm.Segment.attach(
                "test", name, slots=2, slot_bytes=4096, nonce=b"x" * 16, directory=tmp_path
            )
        with pytest.raises(ProtocolError, match="holds 12288 bytes, 16384 offered"):
            shm.Segment.attach(
                "test", name, slots=3, slot_bytes=4096, nonce=nonce, directory=tmp_path
            )
        os.chmod(segment.path, 0o644)
        with pytest.raises(ProtocolError, match="readable by others"):
            shm.Segment.attach(
                "test", name, slots=2, slot_bytes=4096, nonce=nonce, directory=tmp_path
            )
    finally:
        segment.unlink()
        segment.close()


def test_slots_and_lengths_are_checked() -> None:
    segment, _ = shm.Segment.create(RUN_ID, 2, 4096)
    try:
        segment.unlink()
        assert len(segment.slot(1, 4096)) == 4096
        for slot in (2, -1, "0"):
            with pytest.raises(ProtocolError, match=re.escape(f"slot {slot!r} outside 0..1")):
                segment.slot(slot, 1)  # type: ignore[arg-type]
        for length in (0, 4097, 1.5):
            with pytest.raises(ProtocolError, match=re.escape(f"chunk of {length!r} bytes (slot")):
                segment.slot(0, length)  # type: ignore[arg-type]
    finally:
        segment.close()


def test_sweep_removes_the_named_segments_of_its_run_only(tmp_path: Path) -> None:
    ours = [shm.Segment.create("job-a", 1, 4096, directory=tmp_path)[0] for _ in range(2)]
    theirs = shm.Segment.create("job-b", 1, 4096, directory=tmp_path)[0]
    for s in (*ours, theirs):
        s.close()
    assert shm.sweep("job-a", tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == [theirs.path.name]
    theirs.unlink()


def _renamed(path: Path, owner: str) -> Path:
    """``path`` renamed as if process ``owner`` (``PID-START``) had made it."""
    head, _, _, nonce = path.name.rsplit("-", 3)
    moved = path.with_name(f"{head}-{owner}-{nonce}")
    path.rename(moved)
    return moved


@pytest.mark.e2e  # the other job's process: started here
def test_sweep_spares_the_names_of_a_live_process_of_another_job(tmp_path: Path) -> None:
    """Two jobs of one run id on a machine: one's sweep (its agent after a generation)
    leaves the region the other just offered, whose owner runs. A name of a process that
    ended, or of a pid now another process's (start time differs), goes."""
    with subprocess.Popen(["sleep", "60"]) as other:
        try:
            live_owner = shm.owner_tag(other.pid)
            assert live_owner is not None and live_owner.startswith(f"{other.pid}-")
            made = [shm.Segment.create("job-a", 1, 4096, directory=tmp_path)[0] for _ in range(3)]
            for s in made:
                s.close()
            live = _renamed(made[0].path, live_owner)
            pid, start = live_owner.split("-")
            reused = _renamed(made[1].path, f"{pid}-{int(start) + 1}")
            mine = made[2].path  # the sweeping process's own: it leaves the job
            assert shm.sweep("job-a", tmp_path) == 2
            assert [p.name for p in tmp_path.iterdir()] == [live.name]
            assert not reused.exists() and not mine.exists()
            other.kill()
            # ended, not reaped yet (a zombie): it will remove nothing, its names go
            assert _zombie_within(other.pid, 30.0)
            assert shm.owner_tag(other.pid) is None
            assert [p.name for p in shm.left_behind("job-a", tmp_path)] == [live.name]
            assert shm.sweep("job-a", tmp_path) == 1
            assert list(tmp_path.iterdir()) == []
        finally:
            other.kill()


def _zombie_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (stat_fields(pid) or [""])[0] == "Z":
            return True
        time.sleep(0.01)
    return False


def test_a_name_without_its_owner_is_not_attached(tmp_path: Path) -> None:
    segment, nonce = shm.Segment.create("job-a", 1, 4096, directory=tmp_path)
    try:
        head, _, _, tail = segment.path.name.rsplit("-", 3)
        bare = segment.path.rename(segment.path.with_name(f"{head}-{tail}"))
        with pytest.raises(ProtocolError, match="is not one of this run"):
            shm.Segment.attach(
                "job-a", bare.name, slots=1, slot_bytes=4096, nonce=nonce, directory=tmp_path
            )
        assert shm.sweep("job-a", tmp_path) == 1  # another version's name: no owner to wait for
    finally:
        segment.close()


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        ({CHUNK_KEY: [7, 100]}, "slot 7 outside"),
        ({CHUNK_KEY: [0, (1 << 20) + 1]}, "chunk of"),
        ({CHUNK_KEY: [0, 1 << 20]}, "overruns"),
        ({CHUNK_KEY: [0, -5]}, "chunk of"),
        ({CHUNK_KEY: "garbage"}, "malformed"),
        ({CREDIT_KEY: 3}, "not in use"),
    ],
)
async def test_a_malicious_notification_is_a_protocol_violation(frame, problem) -> None:
    async with shm_world(2) as (a, b):
        await touch([a, b])
        target = np.zeros(1000, np.uint8)
        receive = b.irecv(0, tag=Tag(1, 0), out=target)
        conn = a.connection(1)
        assert conn is not None and conn.transport is not None
        head = {"src": 0, "group": 1, "seq": 0, "step": 0, "op": "p2p", "dtype": "uint8"}
        head.update(shape=[1000], gen=a.generation, **{SHM_KEY: 1})
        if CHUNK_KEY in frame:
            conn.transport.write(encode_head(FrameKind.DATA, head, 0))
        conn.transport.write(encode_head(FrameKind.DATA, frame, 0))
        with pytest.raises(PeerFailed, match=problem):
            await receive.wait()
        assert not target.any()  # nothing was written


async def test_a_lost_peer_fails_a_send_waiting_for_a_slot() -> None:
    async with shm_world(2, shm_slots=2, shm_slot_bytes=64 << 10) as (a, b):
        x = np.ones(1 << 20, np.uint8)  # 16 slots' worth; b never receives
        await a.ensure([1])
        peer = b.connection(0)
        assert peer is not None and peer.transport is not None
        peer.shm.on_frame = lambda meta: True  # b swallows chunks, returns no credit
        send = asyncio.ensure_future(a.send(1, x, tag=Tag(1, 0)))
        await asyncio.sleep(0.2)
        assert not send.done()
        peer.transport.abort()
        with pytest.raises(PeerFailed, match="rank 1"):
            async with asyncio.timeout(5):  # well inside the transport's 10 s send timeout
                await send


async def test_a_folding_receive_reduces_straight_out_of_the_slots() -> None:
    async with shm_world(2, shm_slots=2, shm_slot_bytes=64 << 10) as (a, b):
        x = np.arange(100_000, dtype=np.float32)  # 400 KB: 7 slots' worth
        mine = np.full(x.size, 0.5, np.float32)
        acc = np.zeros_like(x)
        out = np.zeros_like(x)
        pieces: list[tuple[int, int]] = []

        def fold(piece: np.ndarray, at: int) -> None:
            pieces.append((at, piece.size))
            np.add(piece, mine[at : at + piece.size], out=acc[at : at + piece.size])

        receive = b.irecv(0, tag=Tag(1, 0), out=out, fold=fold)
        await asyncio.gather(a.send(1, x, tag=Tag(1, 0)), receive.wait())
    np.testing.assert_array_equal(acc, x + mine)
    assert len(pieces) == 7 and pieces[0] == (0, (64 << 10) // 4)
    assert sum(n for _, n in pieces) == x.size
    assert not out.any()  # the bytes were never copied into the receive buffer


async def test_a_folding_receive_over_tcp_folds_the_whole_message_once() -> None:
    async with tcp_world(2) as (a, b):
        x = np.arange(100_000, dtype=np.float64)
        out = np.zeros_like(x)
        calls: list[tuple[int, int]] = []
        receive = b.irecv(0, tag=Tag(1, 0), out=out, fold=lambda p, at: calls.append((at, p.size)))
        await asyncio.gather(a.send(1, x, tag=Tag(1, 0)), receive.wait())
    assert calls == [(0, x.size)]
    np.testing.assert_array_equal(out, x)


async def test_a_chunk_that_splits_an_element_of_a_folding_receive_is_refused() -> None:
    async with shm_world(2) as (a, b):
        await touch([a, b])
        folded = []
        receive = b.irecv(
            0, tag=Tag(1, 0), out=np.zeros(1000, np.float32), fold=lambda p, at: folded.append(at)
        )
        conn = a.connection(1)
        assert conn is not None and conn.transport is not None
        head = {"src": 0, "group": 1, "seq": 0, "step": 0, "op": "p2p", "dtype": "float32"}
        head.update(shape=[1000], gen=a.generation, **{SHM_KEY: 1})
        conn.transport.write(encode_head(FrameKind.DATA, head, 0))
        conn.transport.write(encode_head(FrameKind.DATA, {CHUNK_KEY: [0, 6]}, 0))
        with pytest.raises(PeerFailed, match="splits an element"):
            await receive.wait()
        assert folded == []


async def test_an_offer_never_answered_fails_the_send_within_the_connect_timeout(
    monkeypatch,
) -> None:
    from shardwire.protocol.messages import ShmOffer
    from shardwire.worker.transport.peer import PeerConnection

    answer = PeerConnection._on_control

    def deaf(self, msg) -> None:
        if not isinstance(msg, ShmOffer):
            answer(self, msg)

    monkeypatch.setattr(PeerConnection, "_on_control", deaf)
    async with shm_world(2, connect_timeout=0.5) as (a, _b):
        x = np.ones(SHM_MIN_BYTES, dtype=np.uint8)
        with pytest.raises(ConnectionResetError, match="rank 1 did not answer the shared-memory"):
            await asyncio.wait_for(a.send(1, x, tag=Tag(1, 0)), 30)
