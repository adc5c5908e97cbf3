"""init(): rendezvous, mesh, clean exit and failure propagation, over loopback TCP."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from shardwire.coordinator import JobState
from shardwire.protocol import (
    AuthFailed,
    DescriptorLimit,
    IntegrityError,
    PeerFailed,
    RendezvousError,
    ShardwireError,
    Tag,
    Token,
)
from shardwire.worker import WorkerConfig, init
from shardwire.worker.transport import TcpMesh
from tests.isolation import RUN_ID

from .cluster import coordinator, worker_config


async def _ring_exchange(pg) -> list[int]:
    right, left = (pg.rank + 1) % pg.world_size, (pg.rank - 1) % pg.world_size
    got, _ = await asyncio.gather(
        pg.transport.recv(left, tag=Tag(0, 0)),
        pg.transport.send(right, np.array([pg.rank]), tag=Tag(0, 0)),
    )
    return [pg.rank, int(got[0])]


async def test_four_workers_join_exchange_and_leave() -> None:
    async with coordinator(4) as server:

        async def worker(i: int):
            async with init(worker_config(server, 4, i)) as pg:
                assert (pg.world_size, pg.local_world_size, pg.node_rank) == (4, 4, 0)
                exchanged = await _ring_exchange(pg)
                # connected on first use, to its two ring neighbours only, whose
                # addresses came from the coordinator when first needed
                mesh = pg.transport
                assert isinstance(mesh, TcpMesh) and mesh.book.queries == 1
                met = {p for p in range(4) if mesh.connection(p) is not None}  # closed ones too
                assert met == {(pg.rank + 1) % 4, (pg.rank - 1) % 4}
                return exchanged

        results = await asyncio.gather(*(worker(i) for i in range(4)))
        assert sorted(results) == [[r, (r - 1) % 4] for r in range(4)]
        await asyncio.wait_for(server.done.wait(), 5)
        assert server.rendezvous.state is JobState.FINISHED


async def test_ranks_are_contiguous_per_node() -> None:
    async with coordinator(4) as server:

        async def worker(node: str, local: int):
            cfg = worker_config(server, 4, local, local_world_size=2, node_id=node)
            async with init(cfg) as pg:
                await _ring_exchange(pg)
                return node, local, pg.rank, pg.node_rank

        got = await asyncio.gather(worker("b", 1), worker("a", 0), worker("b", 0), worker("a", 1))
        assert sorted(got) == [("a", 0, 0, 0), ("a", 1, 1, 0), ("b", 0, 2, 1), ("b", 1, 3, 1)]


async def test_requested_ranks_are_honoured() -> None:
    async with coordinator(2) as server:

        async def worker(local: int, node: str, rank: int):
            cfg = worker_config(server, 2, local, local_world_size=1, node_id=node, rank=rank)
            async with init(cfg) as pg:
                await _ring_exchange(pg)
                return pg.rank

        assert await asyncio.gather(worker(0, "a", 1), worker(0, "b", 0)) == [1, 0]


async def test_raising_worker_fails_every_peer_with_its_traceback() -> None:
    async with coordinator(3) as server:
        started = asyncio.Event()

        async def bad():
            async with init(worker_config(server, 3, 2)):
                await started.wait()
                raise ValueError("loss is nan at step 7")

        async def good(i: int):
            async with init(worker_config(server, 3, i)) as pg:
                started.set()
                begin = time.monotonic()
                with pytest.raises(PeerFailed) as info:
                    await pg.transport.recv(2, tag=Tag(0, 0))
                return info.value, time.monotonic() - begin

        results = await asyncio.gather(good(0), good(1), bad(), return_exceptions=True)
        assert isinstance(results[2], ValueError)
        for error, elapsed in results[:2]:
            assert error.rank == 2
            assert "ValueError: loss is nan at step 7" in error.reason
            assert "raise ValueError" in error.remote_traceback
            assert elapsed < 2.0
        await asyncio.wait_for(server.done.wait(), 5)
        assert server.rendezvous.failure.rank == 2


async def test_wrong_token_is_refused_clearly() -> None:
    async with coordinator(1) as server:
        with pytest.raises(AuthFailed, match="token"):
            async with init(worker_config(server, 1, 0, token=Token("wrong"))):
                pass


async def test_a_hard_file_limit_below_the_job_is_refused_before_joining(monkeypatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (1024, 1024))
    async with coordinator(1000) as server:
        with pytest.raises(DescriptorLimit, match="1000-rank job needs 2064 open files"):
            async with init(worker_config(server, 1000, 0)):
                pass
        assert server.rendezvous.state is JobState.WAITING  # it never joined


async def test_wrong_run_id_is_refused() -> None:
    async with coordinator(1) as server:
        with pytest.raises(RendezvousError, match="wrong run id") as info:
            async with init(worker_config(server, 1, 0, run_id="other")):
                pass
        assert info.value.code == "run_id"


async def test_world_size_disagreement_is_refused() -> None:
    async with coordinator(2) as server:
        with pytest.raises(RendezvousError, match="world size disagreement") as info:
            async with init(worker_config(server, 3, 0)):
                pass
        assert info.value.code == "world_size"


async def test_join_timeout_names_what_is_missing() -> None:
    async with coordinator(3, join_timeout=0.3) as server:
        begin = time.monotonic()
        with pytest.raises(RendezvousError, match=r"1 of 3 workers joined") as info:
            async with init(worker_config(server, 3, 0)):
                pass
        assert info.value.code == "join_timeout"
        assert time.monotonic() - begin < 2.0


def _open_sockets() -> set[str]:
    """This process's open sockets, by fd and inode."""
    import os

    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the directory listing's own fd, already closed
            continue
        if target.startswith("socket:"):
            found.add(f"{fd}:{target}")
    return found


async def test_leaving_the_context_leaves_no_task_or_socket_behind() -> None:
    fds_before = _open_sockets()
    tasks_before = asyncio.all_tasks()
    async with coordinator(2) as server:

        async def worker(i: int):
            async with init(worker_config(server, 2, i)) as pg:
                await _ring_exchange(pg)

        await asyncio.gather(*(worker(i) for i in range(2)))
        await asyncio.wait_for(server.done.wait(), 5)
    assert asyncio.all_tasks() == tasks_before
    assert _open_sockets() - fds_before == set()


async def test_failed_join_leaves_nothing_behind() -> None:
    fds_before = _open_sockets()
    tasks_before = asyncio.all_tasks()
    async with coordinator(2) as server:
        with pytest.raises(RendezvousError):
            async with init(worker_config(server, 3, 0)):
                pass
    assert asyncio.all_tasks() == tasks_before
    assert _open_sockets() - fds_before == set()


async def test_node_and_cross_node_groups_from_the_roster() -> None:
    async with coordinator(4) as server:

        async def worker(node: str, local: int):
            cfg = worker_config(server, 4, local, local_world_size=2, node_id=node)
            async with init(cfg) as pg:
                node_sum = await pg.node_group().all_reduce(np.array([pg.rank]))
                cross = await pg.cross_node_group().all_gather(np.array([pg.rank]))
                world = await pg.all_reduce(np.array([1.0]))
                return pg.rank, int(node_sum[0]), cross.tolist(), float(world[0])

        got = sorted(await asyncio.gather(*(worker(n, i) for n in "ab" for i in range(2))))
        assert got == [
            (0, 1, [0, 2], 4.0),
            (1, 1, [1, 3], 4.0),
            (2, 5, [0, 2], 4.0),
            (3, 5, [1, 3], 4.0),
        ]


async def test_status_shows_each_rank_and_its_progress() -> None:
    from shardwire.worker.launcher.options import StatusSettings
    from shardwire.worker.launcher.status import fetch, render

    async with coordinator(2) as server:
        done = asyncio.Event()

        async def worker(i: int):
            async with init(worker_config(server, 2, i)) as pg:
                pg.report_progress(10 * (pg.rank + 1), 123.0)
                await done.wait()

        workers = asyncio.gather(worker(0), worker(1))
        want = [(0, 10, 123.0), (1, 20, 123.0)]
        for _ in range(100):  # status is eventually consistent: poll, bounded
            reply = await fetch(
                StatusSettings(
                    coordinator="{}:{}".format(*server.address),
                    run_id=RUN_ID,
                    token="cluster-token",
                    status_timeout=5,
                )
            )
            if sorted((r.rank, r.step, r.samples_per_s) for r in reply.ranks) == want:
                break
            await asyncio.sleep(0.02)
        done.set()
        await workers
    assert reply.state == "running" and reply.world_size == 2
    assert sorted((r.rank, r.step, r.samples_per_s) for r in reply.ranks) == want
    text = render(reply)
    assert f"run '{RUN_ID}': running, world size 2" in text and "node-a" in text


async def test_heartbeat_interval_sets_how_often_the_coordinator_hears() -> None:
    async with coordinator(1) as server:
        async with init(worker_config(server, 1, 0, heartbeat_interval=0.05)):
            ages = []
            for _ in range(40):
                await asyncio.sleep(0.05)
                ages.append(server.rendezvous.status(time.monotonic()).ranks[0].heartbeat_age_s)
    assert max(ages) < 0.6  # the default (1 s) would let ages reach 1 s


async def test_a_session_leaves_no_control_thread_behind() -> None:
    import threading

    async with coordinator(2) as server:

        async def worker(i: int):
            async with init(worker_config(server, 2, i)) as pg:
                await _ring_exchange(pg)
                return {t.name for t in threading.enumerate()}

        during = await asyncio.gather(worker(0), worker(1))
    assert all("shardwire-control" in names for names in during)
    assert "shardwire-control" not in {t.name for t in threading.enumerate()}


def test_status_render_shows_a_busy_rank_and_where() -> None:
    from shardwire.protocol.messages import RankStatus, StatusReply
    from shardwire.worker.launcher.status import render

    row = dict(node_id="n", host="h", state="running")
    reply = StatusReply(
        run_id="r",
        state="running",
        world_size=2,
        ranks=[
            RankStatus(rank=0, **row),
            RankStatus(rank=1, busy_s=14.2, busy_at="digits.py:33 in load", **row),
        ],
    )
    first, second = render(reply).splitlines()[-2:]
    assert "busy" not in first
    assert second.endswith("busy for 14 s at digits.py:33 in load")


def test_status_render_lists_the_generations_and_the_restart_budget() -> None:
    from shardwire.protocol.messages import GenerationInfo, StatusReply
    from shardwire.worker.launcher.status import render

    reply = StatusReply(
        run_id="r",
        state="running",
        world_size=4,
        generation=2,
        restarts=1,
        max_restarts=3,
        generations=[
            GenerationInfo(
                generation=1,
                world_size=4,
                nodes=2,
                started_age_s=60,
                duration_s=40,
                ended_by="rank 3 failed: killed",
            ),
            GenerationInfo(generation=2, world_size=4, nodes=2, started_age_s=15),
        ],
    )
    lines = render(reply).splitlines()
    assert lines[0] == "run 'r': running, world size 4, generation 2, restarts 1 of 3"
    assert (
        "generation 1: 4 ranks on 2 nodes, started 60 s ago, ran 40.0 s: rank 3 failed: killed"
        in lines[1]
    )
    assert "generation 2: 4 ranks on 2 nodes, started 15 s ago, running" in lines[2]


def test_checksum_setting_is_read_from_the_environment() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert WorkerConfig.from_env(env).checksum is True
    assert WorkerConfig.from_env({**env, "SHARDWIRE_CHECKSUM": "0"}).checksum is False


def test_connect_timeout_and_idle_close_are_read_from_the_environment() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert WorkerConfig.from_env(env).connect_timeout == 60.0
    assert WorkerConfig.from_env({**env, "SHARDWIRE_CONNECT_TIMEOUT": "7.5"}).connect_timeout == 7.5
    assert WorkerConfig.from_env(env).idle_close == 120.0
    assert WorkerConfig.from_env({**env, "SHARDWIRE_IDLE_CLOSE": "0"}).idle_close == 0.0


async def test_the_connect_timeout_and_idle_close_reach_the_mesh() -> None:
    # (what they do: tests/worker/transport/test_lazy.py and test_idle.py)
    async with coordinator(2) as server:

        async def worker(i: int) -> tuple[float, float]:
            cfg = worker_config(server, 2, i, connect_timeout=0.5, idle_close=0.3)
            async with init(cfg) as pg:
                await pg.barrier()
                assert isinstance(pg.transport, TcpMesh)
                for _ in range(400):  # the barrier's connections go idle: poll, bounded
                    if not pg.transport.peers():
                        break
                    await asyncio.sleep(0.05)
                assert pg.transport.peers() == []
                await pg.barrier()  # and the next call dials again
                return pg.transport.config.connect_timeout, pg.transport.idle.after

        got = await asyncio.wait_for(asyncio.gather(worker(0), worker(1)), 60)
        assert got == [(0.5, 0.3), (0.5, 0.3)]


async def test_the_checksum_setting_reaches_the_wire() -> None:
    async with coordinator(2) as server:

        async def worker(i: int):
            async with init(worker_config(server, 2, i, checksum=i == 0)) as pg:
                for _ in range(2):  # rank 1 may finish the first call before rank 0 fails
                    await pg.all_reduce(np.ones(100))

        results = await asyncio.wait_for(
            asyncio.gather(worker(0), worker(1), return_exceptions=True), 30
        )
        assert isinstance(results[0], IntegrityError), results  # rank 1 sent no checksums
        assert "carries no checksum" in str(results[0])
        assert isinstance(results[1], ShardwireError)


def test_status_options_come_from_flags_over_the_environment(monkeypatch) -> None:
    from shardwire.worker.launcher.status import settings_from

    monkeypatch.setenv("SHARDWIRE_COORDINATOR", "127.0.0.9:1234")
    monkeypatch.setenv("SHARDWIRE_RUN_ID", "from-env")
    monkeypatch.setenv("SHARDWIRE_TIMEOUT", "300")  # the workers' collective timeout
    settings = settings_from([], os.environ)
    assert settings.coordinator_address() == ("127.0.0.9", 1234)
    assert (settings.run_id, settings.status_timeout, settings.json_output) == (
        "from-env",
        10.0,
        False,
    )
    flagged = settings_from(["--run-id", "flag", "--timeout", "3", "--json"], os.environ)
    assert (flagged.run_id, flagged.status_timeout, flagged.json_output) == ("flag", 3.0, True)


async def test_node_group_asked_twice_is_one_group_and_closes_with_the_session() -> None:
    async with coordinator(2) as server:

        async def worker(i: int):
            async with init(worker_config(server, 2, i)) as pg:
                node = pg.node_group()
                assert pg.node_group() is node  # one group id, one sequence counter
                await node.all_reduce(np.ones(2))
                transport = pg.transport
            assert len(transport.groups) == 0  # the session closed the world and its subgroups

        await asyncio.wait_for(asyncio.gather(worker(0), worker(1)), 30)


def test_only_init_asks_for_a_launcher_and_names_the_script() -> None:
    from shardwire.worker import NotLaunched
    from shardwire.worker.runtime.launched import check_launched

    with pytest.raises(NotLaunched, match="--nproc-per-node 2 mine.py\n"):
        check_launched({"SHARDWIRE_TOKEN": "t"}, "mine.py")  # a token is not a launcher
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        check_launched({name: "1"}, "mine.py")
    # torch's own rendezvous brings rank and size: its settings read without a launcher
    assert WorkerConfig.from_env({"SHARDWIRE_TIMEOUT": "7"}).timeout == 7.0
