"""Session.reform: survivors of a rank's failure re-form in their processes and keep
their ranks, the failed rank's replacement joins the next generation, and the new group
works; a rank that may not re-form is told why with a typed error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shardwire.protocol import PeerFailed, RecoveryError
from shardwire.protocol.messages import Abort
from shardwire.worker import init

from .cluster import coordinator, worker_config

WORLD = 3


def _config(server, rank: int, **kw):
    return worker_config(server, WORLD, rank, rank=rank, recovery="live", **kw)


async def _fails(server, started: asyncio.Event, gone: asyncio.Event | None = None) -> None:
    try:
        async with init(_config(server, 2)):
            await started.wait()
            raise RuntimeError("out of memory at step 12")
    finally:
        if gone is not None:
            gone.set()


async def _replacement(server, gone: asyncio.Event) -> tuple[int, int, list[float]]:
    await gone.wait()  # the failed rank's new process starts once the old one is gone
    async with init(_config(server, 2)) as pg:
        return pg.rank, pg.generation, list(await pg.all_reduce(np.array([float(pg.rank)])))


async def _survivor(server, rank: int, started: asyncio.Event) -> tuple[int, int, list[float]]:
    session = init(_config(server, rank))
    async with session as pg:
        started.set()
        with pytest.raises(PeerFailed) as failed:
            await pg.all_reduce(np.ones(4))
        assert failed.value.rank == 2
        again = await session.reform(failed.value)
        total = await again.all_reduce(np.array([float(again.rank)]))
        return again.rank, again.generation, list(total)


async def test_survivors_re_form_with_their_ranks_and_the_replacement_joins() -> None:
    async with coordinator(WORLD, max_restarts=1) as server:
        started, gone = asyncio.Event(), asyncio.Event()
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                _survivor(server, 0, started),
                _survivor(server, 1, started),
                _fails(server, started, gone),
                _replacement(server, gone),
                return_exceptions=True,
            ),
            60,
        )
        assert isinstance(outcomes[2], RuntimeError)
        assert outcomes[:2] == [(0, 2, [3.0]), (1, 2, [3.0])]
        assert outcomes[3] == (2, 2, [3.0])


async def test_without_a_restart_left_a_survivor_hears_the_job_is_over() -> None:
    async with coordinator(WORLD, max_restarts=0) as server:
        started = asyncio.Event()

        async def survivor(rank: int) -> None:
            session = init(_config(server, rank))
            async with session as pg:
                started.set()
                with pytest.raises(PeerFailed) as failed:
                    await pg.all_reduce(np.ones(4))
                with pytest.raises(RecoveryError, match="no restart is left"):
                    await session.reform(failed.value)

        outcomes = await asyncio.wait_for(
            asyncio.gather(
                survivor(0), survivor(1), _fails(server, started), return_exceptions=True
            ),
            60,
        )
        assert outcomes[:2] == [None, None]


async def test_a_job_not_recovering_live_refuses_to_re_form() -> None:
    async with coordinator(1) as server:
        session = init(worker_config(server, 1, 0))
        async with session:
            with pytest.raises(RecoveryError, match="--recovery live"):
                await session.reform()
            assert not session.live


async def test_reform_before_joining_is_refused() -> None:
    async with coordinator(1) as server:
        with pytest.raises(RecoveryError, match="joined"):
            await init(_config(server, 0)).reform()


async def test_recovering_runs_the_training_again_on_the_next_generation_s_group() -> None:
    async with coordinator(WORLD, max_restarts=1) as server:
        started, gone = asyncio.Event(), asyncio.Event()

        async def survivor(rank: int) -> list[tuple[int, int]]:
            runs: list[tuple[int, int]] = []

            async def train(group) -> list[tuple[int, int]]:
                runs.append((group.rank, group.generation))
                started.set()
                await group.all_reduce(np.array([float(group.rank)]))  # fails in generation 1
                return runs

            session = init(_config(server, rank))
            async with session:
                return await session.recovering(train)

        outcomes = await asyncio.wait_for(
            asyncio.gather(
                survivor(0),
                survivor(1),
                _fails(server, started, gone),
                _replacement(server, gone),
                return_exceptions=True,
            ),
            60,
        )
        assert outcomes[0] == [(0, 1), (0, 2)] and outcomes[1] == [(1, 1), (1, 2)]


async def test_recovering_without_live_recovery_lets_the_error_through() -> None:
    async with coordinator(2) as server:
        started = asyncio.Event()

        async def survivor() -> None:
            session = init(worker_config(server, 2, 0))

            async def train(group) -> None:
                started.set()
                await group.all_reduce(np.ones(4))

            async with session:
                with pytest.raises(PeerFailed):
                    await session.recovering(train)

        async def fails() -> None:
            async with init(worker_config(server, 2, 1)):
                await started.wait()
                raise RuntimeError("boom")

        outcomes = await asyncio.wait_for(
            asyncio.gather(survivor(), fails(), return_exceptions=True), 60
        )
        assert outcomes[0] is None and isinstance(outcomes[1], RuntimeError)


async def test_a_rank_the_coordinator_names_tells_its_peers_it_failed_as_it_hangs_up() -> None:
    """The coordinator's Abort naming rank 1 (declared failed while its process runs, or
    an orphan of a lost node) may reach rank 1 before its peers: as rank 1 hangs up, its
    peers must learn that rank 1 failed, a failure they re-form after, not that the job
    was stopped (which would end them). The Abort is handed to rank 1's session the way
    its control connection hands it over."""
    async with coordinator(2, max_restarts=1) as server:
        named = init(worker_config(server, 2, 1, rank=1, recovery="live"))
        ready = asyncio.Event()

        async def rank_1() -> None:
            async with named as pg:
                await pg.barrier()
                named._aborted(Abort(rank=1, reason="no heartbeat for 5.0 s", restarting=True))
                ready.set()
                with pytest.raises(PeerFailed):
                    await pg.all_reduce(np.ones(4))

        async def rank_0() -> PeerFailed:
            async with init(worker_config(server, 2, 0, rank=0, recovery="live")) as pg:
                await pg.barrier()
                with pytest.raises(PeerFailed) as failed:
                    await pg.recv(1, tag=9, timeout=30)
                await ready.wait()
                return failed.value

        _, failed = await asyncio.wait_for(asyncio.gather(rank_1(), rank_0()), 60)
        assert failed.rank == 1 and "no heartbeat for 5.0 s" in failed.reason
