"""The job's peer links: the newest totals per rank, directed links joined from both
ends, the slow link named only when it is far from the others, everything bounded; and
the same links in /api/links, /metrics and the closing views of a live job."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

from shardwire.coordinator import Rendezvous, RendezvousConfig
from shardwire.coordinator.http import METRICS_LINKS, MetricsCollector
from shardwire.coordinator.linktable import TIMED_MIN, LinkTable, describe
from shardwire.coordinator.views import links_json, status_reply
from shardwire.protocol.linkreports import LinkReport
from shardwire.protocol.messages import Heartbeat, Join
from shardwire.worker import init
from tests.worker.cluster import coordinator, status_http, worker_config

MB = 1_000_000


def _mesh(table: LinkTable, n: int, *, rate: float = 500 * MB, rtt_us: int = 80, slow=None):
    """Every rank of ``n`` sent 8 MiB to every other; the receiver timed them at ``rate``
    (``slow``: (src, dst, rate) for one link), every connection's round trip ``rtt_us``."""
    nbytes = 8 << 20
    for r in range(n):
        reports = []
        for p in range(n):
            if p == r:
                continue
            into = rate if slow is None or slow[:2] != (p, r) else slow[2]
            reports.append(
                LinkReport(
                    peer=p,
                    path="tcp",
                    bytes_sent=nbytes,
                    bytes_received=nbytes,
                    messages_sent=4,
                    messages_received=4,
                    timed_bytes=nbytes,
                    timed_us=round(nbytes / into * 1e6),
                    peak_bps=round(into),
                    rtt_us=rtt_us,
                )
            )
        table.add(r, reports)


def test_a_link_far_below_the_others_bandwidth_is_named_by_direction() -> None:
    table = LinkTable()
    _mesh(table, 4, slow=(1, 2, 20 * MB))
    slow = table.slow()
    assert slow is not None and (slow.link.src, slow.link.dst, slow.what) == (1, 2, "bandwidth")
    assert abs(slow.value - 20 * MB) < 0.01 * MB and abs(slow.median - 500 * MB) < MB
    assert slow.links == 12
    text = describe(slow, lambda rank: f"10.0.0.{rank + 1}")
    assert text == (
        "link rank 1 (10.0.0.2) -> rank 2 (10.0.0.3) (tcp) is slow: at most 20.0 MB/s against "
        "a median of 500.0 MB/s over 12 links"
    )


def test_a_long_round_trip_is_named_when_bandwidth_says_nothing() -> None:
    table = LinkTable()
    _mesh(table, 4)
    table.add(3, [LinkReport(peer=0, path="tcp", bytes_sent=8 << 20, rtt_us=25_000)])
    slow = table.slow()
    assert slow is not None and slow.what == "round trip"
    assert {slow.link.src, slow.link.dst} == {0, 3} and slow.value == 0.025
    assert "round trip 25.0 ms against a median of 0.08 ms over 6 links" in describe(
        slow, lambda rank: "h"
    )


def test_a_link_whose_receiver_was_busy_once_is_not_named() -> None:
    """Its payloads' average rate is a tenth of the others' (one was read 40 ms late),
    but its fastest payload ran as fast as theirs: the link is fine."""
    table = LinkTable()
    _mesh(table, 4)
    late = LinkReport(
        peer=1,
        path="tcp",
        bytes_sent=8 << 20,
        bytes_received=8 << 20,
        messages_sent=4,
        messages_received=4,
        timed_bytes=8 << 20,
        timed_us=10 * round((8 << 20) / 500),
        peak_bps=500 * MB,
    )
    table.add(2, [late])  # rank 2's newest totals of its link from rank 1
    link = next(k for k in table.links() if (k.src, k.dst) == (1, 2))
    assert link.bandwidth is not None and link.bandwidth < 60 * MB  # shown as measured
    assert table.slow() is None


def test_round_trips_of_a_busy_host_or_of_quiet_links_name_nobody() -> None:
    table = LinkTable()
    _mesh(table, 4, rtt_us=200)
    table.add(3, [LinkReport(peer=0, path="tcp", bytes_sent=8 << 20, rtt_us=1_700)])
    assert table.slow() is None  # 8.5x the median, but scheduling noise on a busy host
    table.add(4, [LinkReport(peer=0, path="tcp", bytes_sent=1000, rtt_us=40_000)])
    table.add(0, [LinkReport(peer=4, path="tcp", bytes_sent=1000, rtt_us=40_000)])
    assert table.slow() is None  # a few small messages: the kernel's estimate says little


def test_links_within_noise_or_too_few_name_nobody() -> None:
    table = LinkTable()
    _mesh(table, 4, slow=(1, 2, 200 * MB))  # 2.5x below the median: noise on a busy host
    assert table.slow() is None
    small = LinkTable()
    _mesh(small, 2, slow=(0, 1, 1 * MB))  # two links: no median to compare with
    assert small.slow() is None
    untimed = LinkTable()  # a link that timed too little is not compared
    untimed.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=10, timed_bytes=TIMED_MIN - 1)])
    assert untimed.links()[0].bandwidth is None


def test_the_newest_totals_count_and_the_table_is_bounded() -> None:
    table = LinkTable(per_rank=3, limit=5)
    table.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=10, messages_sent=1)])
    table.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=30, messages_sent=3)])
    assert [(k.bytes, k.messages) for k in table.links()] == [(30, 3)]
    table.add(0, [LinkReport(peer=p, path="shm", bytes_sent=p) for p in range(1, 10)])
    assert len(table) == 3  # this rank's cap
    table.add(1, [LinkReport(peer=p, path="tcp", bytes_sent=1) for p in (0, 2, 3)])
    assert len(table) == 5  # the whole table's cap


def _big_job(world: int) -> Rendezvous:
    r = Rendezvous(RendezvousConfig(run_id="links", world_size=world))
    for i in range(world):
        join = Join(world_size=world, node_id=f"n{i:03d}", local_rank=0, local_world_size=1)
        r.join(i, join, peer_host=f"10.0.{i // 250}.{i % 250 + 1}", now=0.0)
    return r


def test_heartbeats_feed_the_views_and_metrics_stay_bounded() -> None:
    world = 40
    r = _big_job(world)
    for conn in range(world):  # conn i is rank i: one node each, joined in order
        links = [
            LinkReport(peer=p, path="tcp", bytes_sent=1000 + conn, rtt_us=100)
            for p in range(world)
            if p != conn
        ]
        r.heartbeat(conn, Heartbeat(step=1, links=links), now=1.0)
    body = links_json(r)
    assert body["total"] == world * (world - 1) and body["world_size"] == world
    assert (body["links"][0]["src"], body["links"][0]["bytes"]) == (world - 1, 1000 + world - 1)
    assert len(links_json(r, limit=10)["links"]) == 10
    families = {f.name: f for f in MetricsCollector(r, lambda: 1.0).collect()}
    assert len(families["shardwire_link_sent_bytes"].samples) == METRICS_LINKS
    assert families["shardwire_links"].samples[0].value == world * (world - 1)
    assert families["shardwire_slow_link"].samples == []
    # the rank rows never carry link reports
    assert "links" not in status_reply(r, 1.0).ranks[0].model_dump()


async def test_a_live_job_reports_its_links_on_every_view() -> None:
    async with coordinator(3) as server, status_http(server) as base:
        done = asyncio.Event()

        async def worker(i: int) -> None:
            cfg = worker_config(server, 3, i, heartbeat_interval=0.2, transport="tcp")
            async with init(cfg) as pg:
                # 256 KiB to each, the smallest payload timed: the shorter a payload, the
                # likelier one of a link's 40 is read without a busy host descheduling
                # its process midway, and a link's peak rate is its best payload's
                x = np.ones(3 << 16, dtype=np.float32)
                for _ in range(40):  # every link times enough to be compared
                    await pg.all_to_all(x)
                await done.wait()

        workers = asyncio.gather(*(worker(i) for i in range(3)))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as web:
                body: dict = {}
                for _ in range(400):  # heartbeats carry the links: poll, bounded
                    async with web.get(f"{base}/api/links") as response:
                        body = await response.json()
                    if body["total"] == 6 and all(k["bytes"] >= 10 << 20 for k in body["links"]):
                        break  # every link carried (and timed) all 40 rounds
                    await asyncio.sleep(0.05)
                async with web.get(f"{base}/metrics") as response:
                    metrics = await response.text()
        finally:
            done.set()
            await workers
    pairs = {(k["src"], k["dst"]) for k in body["links"]}
    assert pairs == {(a, b) for a in range(3) for b in range(3) if a != b}, body
    assert all(k["bytes"] > 0 and k["path"] == "tcp" for k in body["links"])
    assert body["slow"] is None, body["slow"]  # a healthy job names no link
    assert 'shardwire_link_sent_bytes_total{dst="1",path="tcp",src="0"}' in metrics
    assert "shardwire_links 6.0" in metrics


def test_shardwire_status_prints_the_slow_link() -> None:
    from shardwire.protocol.messages import StatusReply
    from shardwire.worker.launcher.status import render

    table = LinkTable()
    _mesh(table, 4, slow=(2, 0, 5 * MB))
    slow = table.slow()
    assert slow is not None
    line = describe(slow, lambda rank: "10.0.0.9")
    text = render(StatusReply(run_id="r", state="running", slow_link=line))
    assert f"\nslow link: {line}\n" in text
    assert "slow link" not in render(StatusReply(run_id="r", state="running"))


def test_views_are_computed_at_most_once_a_refresh_while_reports_keep_coming() -> None:
    from shardwire.coordinator.linktable import REFRESH_S

    table = LinkTable()
    table.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=10)])
    first = table.links(now=100.0)
    table.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=20)])
    assert table.links(now=100.0 + REFRESH_S / 2) is first  # one computation, shared
    assert [k.bytes for k in table.links(now=100.0 + REFRESH_S)] == [20]
    table.add(0, [LinkReport(peer=1, path="tcp", bytes_sent=30)])
    assert [k.bytes for k in table.links()] == [30]  # without a clock: as of now
