"""Coordinator replicas against a real etcd server: one leads under its lease, a
standby takes over when the lease lapses, a deposed leader's journal writes are refused
(fencing), the standbys end with the job, and an etcd that does not answer is named."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from shardwire.coordinator.etcd import EtcdClient, EtcdRefused, EtcdUnavailable
from shardwire.coordinator.journal import Deposed, Journal, JournalWorker, StateDirError
from shardwire.coordinator.leadership import POLL, EtcdJournal, Leadership, Term
from shardwire.protocol.errors import InvalidArgument
from shardwire.protocol.messages import Join
from tests.etcdserver import etcd_server, free_ports

pytestmark = pytest.mark.e2e

TTL = 2


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


def _fresh(name: str) -> str:
    """A run id of its own (a test runs once per event loop, against one etcd)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _replica(etcd: str, run: str, name: str) -> Leadership:
    return Leadership(EtcdClient([etcd]), run, name, ttl=TTL)


def _journal(run: str, workers: int = 2, generation: int = 1) -> Journal:
    joins = [
        JournalWorker(
            rank=r,
            host=f"10.0.{r // 8 // 256}.{r // 8 % 256}",  # eight ranks a host
            join=Join(
                world_size=workers,
                node_id=f"node-{r // 8}",
                local_rank=r % 8,
                local_world_size=8,
                listen_port=9000 + r % 8,
            ),
        )
        for r in range(workers)
    ]
    return Journal(
        run_id=run,
        generation=generation,
        restarts=0,
        max_restarts=0,
        world_size=workers,
        local_world_size=8,
        workers=joins,
        nodes=[],
    )


async def test_one_replica_leads_and_a_standby_takes_over_when_its_lease_lapses(etcd) -> None:
    run = _fresh("takeover")
    a, b = _replica(etcd, run, "a:1"), _replica(etcd, run, "b:2")
    term = await a.campaign(print)
    assert isinstance(term, Term) and term.epoch > 0
    heard: list[str] = []
    standby = asyncio.create_task(b.campaign(heard.append))
    try:
        await asyncio.sleep(3 * POLL)
        assert not standby.done() and heard == [f"standby: a:1 leads run {run!r}"]
        EtcdJournal(a, run).write(_journal(run, generation=4))
        # a dies: nobody renews its lease; b leads once etcd lets it lapse
        died = time.monotonic()
        async with asyncio.timeout(30):
            second = await standby
        took = time.monotonic() - died
    finally:
        standby.cancel()
    assert isinstance(second, Term) and second.epoch > term.epoch
    assert took < 30  # etcd's own clock; its figure is in the coordinator failover test
    journal = EtcdJournal(b, run)
    read = journal.read()
    assert read is not None and read.generation == 4  # what a wrote, b resumes
    # fencing: a deposed leader's decision never reaches the journal
    with pytest.raises(Deposed, match="no longer leads"):
        EtcdJournal(a, run).write(_journal(run, generation=5))
    journal.write(_journal(run, generation=5))
    assert journal.read().generation == 5  # type: ignore[union-attr]
    journal.remove()
    assert journal.read() is None


async def test_a_leader_whose_lease_is_gone_hears_it_is_deposed(etcd) -> None:
    a = _replica(etcd, _fresh("deposed"), "a:1")
    term = await a.campaign(print)
    assert isinstance(term, Term)
    why: list[str] = []
    heard = asyncio.Event()
    keeper = a.hold(lambda reason: (why.append(reason), heard.set()))
    try:
        time.sleep(TTL)  # noqa: ASYNC251 (the loop blocked, as by ten thousand joins)
        await asyncio.sleep(TTL)
        assert not why
        assert a.client.keepalive(term.lease) > 0  # still held
        a.client.revoke(term.lease)  # as etcd does when renewals stop reaching it
        async with asyncio.timeout(30):
            await heard.wait()
    finally:
        await asyncio.to_thread(keeper.stop)
    assert why and "lease expired" in why[0]


async def test_the_standbys_end_with_the_job_and_a_later_job_of_that_run_id_leads(etcd) -> None:
    run = _fresh("ends")
    a, b = _replica(etcd, run, "a:1"), _replica(etcd, run, "b:2")
    assert isinstance(await a.campaign(print), Term)
    standby = asyncio.create_task(b.campaign(print))
    await asyncio.sleep(2 * POLL)
    await a.conclude("failed")
    async with asyncio.timeout(30):
        assert await standby == "failed"
    # a new job reusing the run id: the old end is not its end
    c = _replica(etcd, run, "c:3")
    async with asyncio.timeout(30):
        assert isinstance(await c.campaign(print), Term)
    await c.conclude("finished")


async def test_a_journal_of_ten_thousand_workers_is_one_small_write(etcd) -> None:
    run = _fresh("big")
    a = _replica(etcd, run, "a:1")
    assert isinstance(await a.campaign(print), Term)
    store = EtcdJournal(a, run)
    journal = _journal(run, workers=10_000)
    store.write(journal)
    assert store.read() == journal
    stored = a.client.get(store.key)
    assert stored is not None and len(stored.value) < 1 << 20  # etcd takes 1.5 MiB at most
    await a.conclude("finished")


def test_another_runs_journal_is_refused_naming_the_key(etcd) -> None:
    run = _fresh("mine")
    a = _replica(etcd, run, "a:1")
    assert isinstance(asyncio.run(a.campaign(print)), Term)
    store = EtcdJournal(a, run)
    store.write(_journal("other"))
    with pytest.raises(StateDirError, match=f"/shardwire/{run}/journal at .* holds run 'other'"):
        store.read()
    asyncio.run(a.conclude("finished"))


def test_an_etcd_that_does_not_answer_is_named_with_what_each_endpoint_said() -> None:
    (port,) = free_ports(1)
    client = EtcdClient([f"127.0.0.1:{port}"], timeout=0.2, patience=0.5)
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable, match=rf"http://127.0.0.1:{port}: .*refused"):
        client.get("/x")
    assert time.monotonic() - start < 10  # bounded by its patience, not a hang
    with pytest.raises(InvalidArgument, match="etcd's TLS is not supported"):
        EtcdClient(["https://127.0.0.1:2379"])


def test_a_request_etcd_refuses_says_what_etcd_said(etcd) -> None:
    client = EtcdClient([etcd])
    with pytest.raises(EtcdRefused, match=r"etcd refused /v3/kv/range: .*illegal base64"):
        client.call("/v3/kv/range", {"key": "not base64!"})
