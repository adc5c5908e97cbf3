"""Every data frame is checksummed: a byte flipped on the wire, in the payload or in the
meta, fails the collective with IntegrityError on every rank of the group instead of
changing the result; with checksums off the same flip goes through unnoticed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from shardwire.protocol import IntegrityError, PeerFailed
from shardwire.worker.collectives import Group
from shardwire.worker.transport import MeshConfig, TcpMesh
from tests.e2e.abuse import FlipProxy

from .fabric import TOKEN, book_for, close_all, placement_for, start_all


@contextlib.asynccontextmanager
async def _pair_via(proxy: FlipProxy, *, checksum: bool = True) -> AsyncIterator[list[Group]]:
    """Two ranks whose only link (rank 1 dials rank 0) runs through ``proxy``."""
    meshes = [
        TcpMesh(MeshConfig(run_id="test", token=TOKEN, checksum=checksum), timeout=10)
        for _ in range(2)
    ]
    groups: list[Group] = []
    try:
        ports = [await m.listen() for m in meshes]
        proxy.target = ("127.0.0.1", ports[0])
        detour = await proxy.start()
        meshes[0].start(placement_for(2, 0), book_for(ports))
        meshes[1].start(placement_for(2, 1), book_for([detour, ports[1]]))
        async with asyncio.timeout(10):
            await meshes[1].ensure([0])  # before rank 0 sends: it would dial rank 1 directly
        groups = [Group(m, timeout=10) for m in meshes]
        yield groups
    finally:
        await close_all(groups, meshes, [proxy])


def _inputs() -> list[np.ndarray]:
    return [np.linspace(0, 1, 5000) + r for r in range(2)]


async def _all_reduce(groups: list[Group]) -> list[np.ndarray | BaseException]:
    xs = _inputs()
    async with asyncio.timeout(30):
        return await asyncio.gather(
            *(g.all_reduce(x.copy()) for g, x in zip(groups, xs, strict=True)),
            return_exceptions=True,
        )


@pytest.mark.parametrize(
    ("part", "after"),
    [("payload", b""), ("meta", b"\xa3seq")],  # a data byte; the call's sequence number
    ids=["payload", "meta-seq"],
)
async def test_a_flipped_byte_fails_the_collective_on_every_rank(part, after) -> None:
    proxy = FlipProxy(("", 0), nth=1, part=part, after=after, offset=1234)
    async with _pair_via(proxy) as groups:
        results = await _all_reduce(groups)
        assert proxy.flipped == 1
        first = results[0]
        assert isinstance(first, IntegrityError), results
        assert first.peer == 1
        if part == "payload":  # (a flipped meta byte may be the sequence number itself)
            assert first.seq == 1  # the group's first call
        assert "all_reduce" in first.op
        assert "from rank 1 on rank 0" in str(first)
        # The sender may have finished its part of the call; the group is poisoned on
        # every rank, so its next call (if not this one) fails with the relayed error.
        relayed = results[1]
        if not isinstance(relayed, IntegrityError):
            with pytest.raises(IntegrityError) as caught:
                async with asyncio.timeout(30):
                    await groups[1].all_reduce(np.ones(3))
            relayed = caught.value
        assert "integrity check failed" in str(relayed)
        with pytest.raises(IntegrityError):
            await groups[0].all_reduce(np.ones(3))


async def test_an_intact_link_through_the_proxy_gives_the_exact_sum() -> None:
    proxy = FlipProxy(("", 0), nth=10**9)  # never flips
    async with _pair_via(proxy) as groups:
        results = await _all_reduce(groups)
        expected = sum(_inputs())
        for r in results:
            np.testing.assert_array_equal(r, expected)


async def test_without_checksums_a_flipped_payload_byte_goes_unnoticed() -> None:
    proxy = FlipProxy(("", 0), nth=1, part="payload", offset=1234)
    async with _pair_via(proxy, checksum=False) as groups:
        results = await _all_reduce(groups)
        assert proxy.flipped == 1
        assert not any(isinstance(r, BaseException) for r in results)
        assert not np.array_equal(results[0], sum(_inputs()))  # silently wrong


async def test_a_rank_expecting_checksums_refuses_frames_without_them() -> None:
    meshes = [
        TcpMesh(MeshConfig(run_id="test", token=TOKEN, checksum=on), timeout=10)
        for on in (True, False)
    ]
    try:
        ports = [await m.listen() for m in meshes]
        start_all(meshes, ports)
        groups = [Group(m, timeout=10) for m in meshes]
        results = await _all_reduce(groups)
        assert isinstance(results[0], IntegrityError)
        assert "carries no checksum" in str(results[0])
        for g in groups:
            await g.aclose()
    finally:
        for m in meshes:
            await m.aclose()


async def test_a_link_cut_in_the_middle_of_a_payload_fails_both_ranks_at_once() -> None:
    proxy = FlipProxy(("", 0), part="cut", offset=300_000)  # inside the first payload
    async with _pair_via(proxy) as groups:
        x = np.arange(200_000.0)
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(g.all_reduce(x.copy()) for g in groups), return_exceptions=True
            )
        assert proxy.flipped == 1
        assert all(isinstance(r, PeerFailed) for r in results), results
        assert asyncio.get_running_loop().time() - started < 5  # not the 10 s timeout
