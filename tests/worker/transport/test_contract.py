"""One contract, two transports: in-memory hub and TCP mesh behave the same."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shardwire.protocol import InvalidArgument, MessageMismatch, PeerFailed, Tag, TransportClosed
from shardwire.worker.transport import TransportTimeout

from .fabric import WORLDS

pytestmark = pytest.mark.parametrize("kind", sorted(WORLDS))


async def test_send_recv_into_out_array(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        data = np.arange(1000, dtype=np.float64)
        out = np.zeros_like(data)
        got, _ = await asyncio.gather(
            b.recv(0, tag=Tag(0, 1), out=out), a.send(1, data, tag=Tag(0, 1))
        )
        assert got is out
        np.testing.assert_array_equal(out, data)


async def test_early_arrival_is_held_until_receive(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        await a.send(1, np.full((3, 4), 7, np.int32), tag=Tag(0, 5))
        await a.send(1, np.full((2,), 9, np.int32), tag=Tag(0, 6))
        second = await b.recv(0, tag=Tag(0, 6))
        first = await b.recv(0, tag=Tag(0, 5))
        assert first.shape == (3, 4) and first.dtype == np.int32 and (first == 7).all()
        assert second.tolist() == [9, 9]


async def test_same_tag_is_first_in_first_out(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        for i in range(5):
            await a.send(1, np.array([i], np.int64), tag=Tag(3, 0))
        got = [int((await b.recv(0, tag=Tag(3, 0)))[0]) for _ in range(5)]
        assert got == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
)
async def test_every_dtype_round_trips(kind: str, dtype: str) -> None:
    rng = np.random.default_rng(0)
    data = (rng.standard_normal((17, 3)) * 50).astype(dtype)
    async with WORLDS[kind](2) as (a, b):
        got, _ = await asyncio.gather(b.recv(0, tag=Tag(0, 0)), a.send(1, data, tag=Tag(0, 0)))
        assert got.dtype == data.dtype
        np.testing.assert_array_equal(got, data)


async def test_empty_and_scalar_arrays(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        await a.send(1, np.zeros((0, 5), np.float32), tag=Tag(0, 1))
        await a.send(1, np.array(2.5), tag=Tag(0, 2))
        empty = await b.recv(0, tag=Tag(0, 1))
        scalar = await b.recv(0, tag=Tag(0, 2))
        assert empty.shape == (0, 5)
        assert scalar.shape == () and float(scalar) == 2.5


async def test_all_pairs_exchange(kind: str) -> None:
    n = 4
    async with WORLDS[kind](n) as ts:

        async def run(t):
            sends = [
                t.send(p, np.array([t.rank, p]), tag=Tag(1, 0)) for p in range(n) if p != t.rank
            ]
            recvs = [t.recv(p, tag=Tag(1, 0)) for p in range(n) if p != t.rank]
            results = await asyncio.gather(*recvs, *sends)
            return [r.tolist() for r in results[: n - 1]]

        out = await asyncio.gather(*(run(t) for t in ts))
        for rank, got in enumerate(out):
            assert got == [[p, rank] for p in range(n) if p != rank]


async def test_large_message_into_out(kind: str) -> None:
    data = np.random.default_rng(1).standard_normal(4 << 20)  # 32 MiB
    out = np.empty_like(data)
    async with WORLDS[kind](2) as (a, b):
        await asyncio.gather(b.recv(0, tag=Tag(0, 0), out=out), a.send(1, data, tag=Tag(0, 0)))
        np.testing.assert_array_equal(out, data)


async def test_mismatched_shape_raises_naming_ranks_and_op(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        out = np.zeros(4, np.float32)
        send = a.send(1, np.zeros(5, np.float32), tag=Tag(0, 17), op="all_gather")
        with pytest.raises(MessageMismatch, match=r"rank 1 from rank 0.*all_gather #17.*\[5\]"):
            await asyncio.gather(b.recv(0, tag=Tag(0, 17), op="all_gather", out=out), send)
        # the stream stays usable after a mismatch
        got, _ = await asyncio.gather(
            b.recv(0, tag=Tag(0, 18)), a.send(1, np.ones(2), tag=Tag(0, 18))
        )
        assert got.tolist() == [1.0, 1.0]


async def test_mismatched_op_raises(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        await a.send(1, np.zeros(2), tag=Tag(0, 3), op="broadcast")
        with pytest.raises(
            MessageMismatch, match="rank 1 called all_reduce, but rank 0 called broadcast"
        ):
            await b.recv(0, tag=Tag(0, 3), op="all_reduce")


async def test_receive_timeout_names_peer_and_op(kind: str) -> None:
    async with WORLDS[kind](2) as (_a, b):
        start = time.monotonic()
        with pytest.raises(TransportTimeout, match=r"receive of reduce #9 from rank 0"):
            await b.recv(0, tag=Tag(0, 9), op="reduce", timeout=0.2)
        assert time.monotonic() - start < 2.0


async def test_abort_fails_pending_and_later_calls(kind: str) -> None:
    async with WORLDS[kind](3) as (a, b, _c):
        pending = asyncio.ensure_future(b.recv(0, tag=Tag(0, 0)))
        await asyncio.sleep(0)
        b.abort(PeerFailed(rank=2, reason="test"))
        with pytest.raises(PeerFailed) as info:
            await pending
        assert info.value.rank == 2
        with pytest.raises(PeerFailed):
            await b.send(0, np.zeros(1), tag=Tag(0, 1))
        del a


async def test_closed_transport_refuses(kind: str) -> None:
    async with WORLDS[kind](2) as (a, _b):
        await a.aclose()
        with pytest.raises(TransportClosed):
            await a.send(1, np.zeros(1), tag=Tag(0, 0))


async def test_invalid_peer_is_rejected(kind: str) -> None:
    async with WORLDS[kind](2) as (a, _b):
        with pytest.raises(InvalidArgument, match="peer 0 is not another rank"):
            await a.send(0, np.zeros(1), tag=Tag(0, 0))


async def test_sender_may_reuse_buffer_after_send(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        buf = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: larger than socket buffers
        expected = buf.copy()
        recv = asyncio.ensure_future(b.recv(0, tag=Tag(0, 0)))
        await a.send(1, buf, tag=Tag(0, 0))
        buf[:] = -1  # must not affect what the receiver gets
        got = await recv
        np.testing.assert_array_equal(got, expected)


async def test_large_messages_received_out_of_order(kind: str) -> None:
    first = np.arange(300_000, dtype=np.float64)
    second = -np.arange(200_000, dtype=np.float64)
    async with WORLDS[kind](2) as (a, b):
        sender = asyncio.ensure_future(
            asyncio.gather(a.send(1, first, tag=Tag(0, 1)), a.send(1, second, tag=Tag(0, 2)))
        )
        got_second = await b.recv(0, tag=Tag(0, 2))
        out = np.empty_like(first)
        got_first = await b.recv(0, tag=Tag(0, 1), out=out)
        await sender
        np.testing.assert_array_equal(got_second, second)
        assert got_first is out
        np.testing.assert_array_equal(out, first)


async def test_head_to_head_large_sends_do_not_deadlock(kind: str) -> None:
    data = [np.full(1 << 21, r, np.float64) for r in range(2)]  # 16 MiB each
    async with WORLDS[kind](2) as ts:

        async def run(t):
            await t.send(1 - t.rank, data[t.rank], tag=Tag(0, 0))
            return await t.recv(1 - t.rank, tag=Tag(0, 0))

        got = await asyncio.gather(*(run(t) for t in ts))
        assert got[0][0] == 1 and got[1][-1] == 0


async def test_many_large_messages_in_a_row_arrive_intact(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        msgs = [np.full(100_000, i, np.int32) for i in range(20)]

        async def produce():
            for i, m in enumerate(msgs):
                await a.send(1, m, tag=Tag(0, i))

        producer = asyncio.ensure_future(produce())
        out = np.empty(100_000, np.int32)
        for i in range(20):
            await b.recv(0, tag=Tag(0, i), out=out)
            assert (out == i).all()
        await producer


async def test_mismatch_is_caught_across_different_steps(kind: str) -> None:
    async with WORLDS[kind](2) as (a, b):
        # rank 0 runs some other call #4 whose frames use a step rank 1 never receives
        await a.send(1, np.zeros(2), tag=Tag(0, 4, step=9), op="all_gather:float64")
        with pytest.raises(MessageMismatch, match="rank 0 called all_gather:float64"):
            await b.recv(0, tag=Tag(0, 4, step=0), op="all_reduce:float64:sum", timeout=5)


async def test_poisoned_group_fails_pending_and_later_receives(kind: str) -> None:
    from shardwire.protocol import CollectiveTimeout

    async with WORLDS[kind](3) as (a, b, c):
        pending = b.irecv(2, tag=Tag(7, 1))
        other_group = b.irecv(2, tag=Tag(8, 1))
        a.poison_group(7, CollectiveTimeout("all_reduce #1 timed out on rank 0"), [0, 1, 2])
        with pytest.raises(CollectiveTimeout, match="timed out on rank 0"):
            await pending.wait()
        with pytest.raises(CollectiveTimeout):
            await c.recv(0, tag=Tag(7, 2), timeout=5)
        assert not other_group.done()
        other_group.cancel()
