"""Receives from any source, on both transports: the first message of the tag from
whichever rank, early or late, small or large; receives naming a source keep theirs;
timeouts, poison and aborts end them like any receive."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import MessageMismatch, PeerFailed, Tag
from shardwire.worker.transport import TransportTimeout
from tests.waiting import until
from tests.worker.collectives.worlds import group_world

from .fabric import WORLDS

pytestmark = pytest.mark.parametrize("kind", sorted(WORLDS))


async def test_a_message_already_here_is_taken_with_its_source(kind: str) -> None:
    async with WORLDS[kind](3) as (a, b, c):
        await c.send(0, np.array([20.0]), tag=Tag(0, 7))
        await until(lambda: a.mailbox.early_bytes > 0, "rank 2's message held by rank 0")
        src, got = await a.recv_any(tag=Tag(0, 7), timeout=30)
        assert (src, got.tolist()) == (c.rank, [20.0])
        assert a.mailbox.early_bytes == 0
        await b.send(0, np.array([10.0]), tag=Tag(0, 7))  # the same tag, now from rank 1
        await until(lambda: a.mailbox.early_bytes > 0, "rank 1's message held by rank 0")
        src, got = await a.recv_any(tag=Tag(0, 7), timeout=30)
        assert (src, got.tolist()) == (b.rank, [10.0])


async def test_every_sender_is_received_once_whoever_comes_first(kind: str) -> None:
    async with WORLDS[kind](4) as world:
        receiver, senders = world[0], world[1:]
        big = 300_000  # large enough for shared memory where the transport has it

        async def send(t) -> None:
            await asyncio.sleep(0.01 * (4 - t.rank))
            await t.send(0, np.full(big, float(t.rank)), tag=Tag(2, 1))

        async def receive_all() -> list[tuple[int, float]]:
            got = []
            for _ in senders:
                out = np.empty(big)
                src, array = await receiver.recv_any(tag=Tag(2, 1), out=out, timeout=30)
                assert array is out and (out == src).all()
                got.append((src, float(out[0])))
            return got

        got, *_ = await asyncio.gather(receive_all(), *(send(t) for t in senders))
        assert sorted(got) == [(1, 1.0), (2, 2.0), (3, 3.0)]


async def test_a_receive_naming_the_source_is_served_before_any_source(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        anyone = asyncio.ensure_future(a.recv_any(tag=Tag(0, 3), timeout=30))
        named = asyncio.ensure_future(a.recv(1, tag=Tag(0, 3), timeout=30))
        await asyncio.sleep(0.02)
        await b.send(0, np.array([1]), tag=Tag(0, 3))
        assert (await named).tolist() == [1]
        assert not anyone.done()
        await b.send(0, np.array([2]), tag=Tag(0, 3))
        src, second = await anyone
        assert (src, second.tolist()) == (1, [2])


async def test_other_tags_are_left_alone(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        await b.send(0, np.array([5]), tag=Tag(0, 4))
        with pytest.raises(TransportTimeout, match="from any rank timed out"):
            await a.recv_any(tag=Tag(0, 9), timeout=0.2)
        assert (await a.recv(1, tag=Tag(0, 4), timeout=30)).tolist() == [5]
        await b.send(0, np.array([6]), tag=Tag(0, 9))  # the timed-out receive is gone
        assert (await a.recv(1, tag=Tag(0, 9), timeout=30)).tolist() == [6]


async def test_a_wrong_shape_is_a_mismatch_naming_the_sender(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        await b.send(0, np.zeros(3), tag=Tag(0, 2))
        with pytest.raises(MessageMismatch, match="rank 1"):
            await a.recv_any(tag=Tag(0, 2), out=np.zeros(4), timeout=30)


async def test_poison_and_abort_end_a_receive_from_any_source(kind: str) -> None:
    async with WORLDS[kind](2) as (a, _b):
        pending = asyncio.ensure_future(a.recv_any(tag=Tag(5, 1), timeout=30))
        await asyncio.sleep(0.01)
        a.mailbox.poison_group(5, RuntimeError("group 5 failed"))
        with pytest.raises(RuntimeError, match="group 5 failed"):
            await pending
        with pytest.raises(RuntimeError, match="group 5 failed"):  # and later ones
            await a.recv_any(tag=Tag(5, 2), timeout=30)
        pending = asyncio.ensure_future(a.recv_any(tag=Tag(6, 1), timeout=30))
        await asyncio.sleep(0.01)
        a.abort(PeerFailed(rank=1, reason="killed"))
        with pytest.raises(PeerFailed):
            await pending


async def test_a_group_names_the_sender_by_its_group_rank(kind: str) -> None:
    async with group_world(kind, 3) as groups:
        subs = [g.new_group([1, 2], name="pair") for g in groups[1:]]
        got, _ = await asyncio.gather(
            subs[0].recv_any(tag=8), subs[1].send(np.array([4.0]), 0, tag=8)
        )
        assert (got[0], got[1].tolist()) == (1, [4.0])  # global rank 2 is group rank 1
