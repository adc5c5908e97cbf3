"""The coordinator's HTTP side: health, readiness, JSON status, Prometheus metrics and a
self-refreshing status page. Read-only views of the rendezvous state; bound to
127.0.0.1 unless told otherwise."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shardwire.coordinator.listening import in_use, refused
from shardwire.coordinator.page import STATUS_PAGE
from shardwire.coordinator.rendezvous import Rendezvous
from shardwire.coordinator.state import JobState
from shardwire.coordinator.views import API_LINKS, links_json, rank_summary

Clock = Callable[[], float]
log = logging.getLogger(__name__)
_SHUTDOWN_GRACE = 2.0  # seconds in-flight requests get when the coordinator stops


API_PAGE = 1000  # rank rows per /api/status response (``?offset=&limit=`` pages on)
METRICS_RANKS = 1024  # ranks with series of their own in /metrics (then aggregates only)
METRICS_LINKS = 256  # links with series of their own in /metrics: the busiest ones


def status_json(
    rdzv: Rendezvous, now: float, wall: float, offset: int = 0, limit: int = API_PAGE
) -> dict:
    """The job for machines: state, rank rows ``offset`` onwards (at most ``limit``, and
    ``total`` of them), recent events (wall-clock times), and rank 0's progress: steps
    against the total with the time left, losses, held-out losses, throughput."""
    reply = rdzv.status(now, offset, max(1, min(limit, API_PAGE)))
    body = reply.model_dump(exclude={"kind"})
    for g in body["generations"]:
        g["started_at"] = wall - g["started_age_s"]
    return {
        **body,
        "events": [{"time": wall - (now - t), "text": text} for t, text in rdzv.events],
        **rdzv.curves.view(now, wall),
    }


def _lateness(rdzv: Rendezvous) -> Iterator:
    """Who arrives last into collectives (the ranks that ever were, at most METRICS_RANKS
    of them, most often last first)."""
    last = GaugeMetricFamily(
        "shardwire_rank_last_share",
        "Share of its recent collectives the rank was the last to enter",
        labels=["rank"],
    )
    late = GaugeMetricFamily(
        "shardwire_rank_late_seconds",
        "How late the rank was, on average, into the collectives it entered last",
        labels=["rank"],
    )
    for row in rdzv.stragglers.ranks()[:METRICS_RANKS]:
        last.add_metric([str(row.rank)], row.share)
        late.add_metric([str(row.rank)], row.late_s)
    top = rdzv.stragglers.straggler()
    yield from (last, late)
    yield GaugeMetricFamily(
        "shardwire_straggler_rank",
        "The rank that holds the others up (-1: none does)",
        value=-1 if top is None else top.rank,
    )


def _links(rdzv: Rendezvous, now: float) -> Iterator:
    """The busiest METRICS_LINKS directed links, and the slow one if a link is."""
    labels = ["src", "dst", "path"]
    sent = CounterMetricFamily(
        "shardwire_link_sent_bytes", "Payload bytes sent over the link", labels=labels
    )
    messages = CounterMetricFamily(
        "shardwire_link_messages", "Messages sent over the link", labels=labels
    )
    rate = GaugeMetricFamily(
        "shardwire_link_bandwidth_bytes_per_second",
        "Achieved bandwidth of the link's large payloads, as the receiver timed them",
        labels=labels,
    )
    rtt = GaugeMetricFamily(
        "shardwire_link_rtt_seconds", "Smoothed TCP round-trip time of the pair", labels=labels
    )
    found = rdzv.links.links(now)
    for link in found[:METRICS_LINKS]:
        label = [str(link.src), str(link.dst), link.path]
        sent.add_metric(label, link.bytes)
        messages.add_metric(label, link.messages)
        if link.bandwidth is not None:
            rate.add_metric(label, link.bandwidth)
        if link.rtt_s is not None and link.path == "tcp":
            rtt.add_metric(label, link.rtt_s)
    yield from (sent, messages, rate, rtt)
    yield GaugeMetricFamily(
        "shardwire_links", "Directed peer links that carried bytes", value=len(found)
    )
    slow = GaugeMetricFamily(
        "shardwire_slow_link",
        "1 for the link far slower than the others (what: bandwidth or round trip)",
        labels=[*labels, "what"],
    )
    worst = rdzv.links.slow(now)
    if worst is not None:
        k = worst.link
        slow.add_metric([str(k.src), str(k.dst), k.path, worst.what], 1.0)
    yield slow


class MetricsCollector(Collector):
    """Prometheus view, computed at scrape time (base units, ``shardwire_`` prefix)."""

    def __init__(self, rdzv: Rendezvous, clock: Clock):
        self._rdzv, self._clock = rdzv, clock

    def collect(self) -> Iterator:
        # rows for the ranks with series of their own only; the aggregates read every
        # worker without building a row for each (a scrape of 10,000 stays short)
        reply = self._rdzv.status(self._clock(), 0, METRICS_RANKS)
        states, (step_low, step_high) = rank_summary(self._rdzv)
        state = GaugeMetricFamily(
            "shardwire_job_state", "1 for the job's current state", labels=["state"]
        )
        for s in JobState:
            state.add_metric([s.value], 1.0 if s.value == reply.state else 0.0)
        yield state
        yield GaugeMetricFamily(
            "shardwire_world_size", "Worker processes in the job", value=reply.world_size
        )
        step = GaugeMetricFamily("shardwire_rank_step", "Last reported step", labels=["rank"])
        rate = GaugeMetricFamily(
            "shardwire_rank_samples_per_second",
            "Last reported training throughput",
            labels=["rank"],
        )
        age = GaugeMetricFamily(
            "shardwire_rank_heartbeat_age_seconds",
            "Seconds since the rank's last heartbeat",
            labels=["rank"],
        )
        loss = GaugeMetricFamily("shardwire_rank_loss", "Last reported loss", labels=["rank"])
        sent = CounterMetricFamily(
            "shardwire_rank_sent_bytes", "Payload bytes sent", labels=["rank"]
        )
        received = CounterMetricFamily(
            "shardwire_rank_received_bytes", "Payload bytes received", labels=["rank"]
        )
        ranks = GaugeMetricFamily(
            "shardwire_ranks", "Ranks of the current generation, by state", labels=["state"]
        )
        for name, count in sorted(states.items()):
            ranks.add_metric([name], count)
        yield ranks
        yield GaugeMetricFamily("shardwire_step_min", "Lowest step reported", value=step_low)
        yield GaugeMetricFamily("shardwire_step_max", "Highest step reported", value=step_high)
        for r in reply.ranks[:METRICS_RANKS]:  # a bounded number of series per scrape
            label = [str(r.rank)]
            step.add_metric(label, r.step)
            rate.add_metric(label, r.samples_per_s)
            age.add_metric(label, r.heartbeat_age_s)
            if r.loss is not None:
                loss.add_metric(label, r.loss)
            sent.add_metric(label, r.bytes_sent)
            received.add_metric(label, r.bytes_received)
        yield from (step, rate, age, loss, sent, received)
        yield from _lateness(self._rdzv)
        yield from _links(self._rdzv, self._clock())
        failures = CounterMetricFamily("shardwire_failures", "Worker failures seen")
        failures.add_metric([], reply.restarts + (1.0 if reply.state == "failed" else 0.0))
        yield failures
        yield GaugeMetricFamily(
            "shardwire_generation",
            "The generation being formed or running (1 until the first restart)",
            value=reply.generation,
        )
        beats = CounterMetricFamily(
            "shardwire_heartbeats",
            "Heartbeats applied, by how they came: from the worker, or batched by its node agent",
            labels=["via"],
        )
        for via, count in self._rdzv.beats_via.items():
            beats.add_metric([via], count)
        yield beats
        restarts = CounterMetricFamily(
            "shardwire_restarts", "Failures answered with a restart of the job"
        )
        restarts.add_metric([], reply.restarts)
        yield restarts


class _Refused(asyncio.Protocol):
    """Closes a connection over the listener's limit on arrival."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class StatusHTTP:
    """aiohttp application serving the views; ``start``/``aclose`` own its runner and
    listener.

    A connection that has not sent a complete request within ``request_timeout`` seconds
    is closed (aiohttp's keep-alive timer also runs from the moment a connection opens),
    as is an idle keep-alive connection; at most ``max_connections`` are open at once.
    """

    def __init__(
        self,
        rdzv: Rendezvous,
        *,
        clock: Clock = time.monotonic,
        request_timeout: float = 10.0,
        max_connections: int = 256,
    ):
        self._rdzv = rdzv
        self._clock = clock
        self._registry = CollectorRegistry()
        self._registry.register(MetricsCollector(rdzv, clock))
        self._request_timeout = request_timeout
        self._max_connections = max_connections
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.address: tuple[str, int] = ("", 0)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/links", self._links)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/", self._page)
        return app

    async def start(self, host: str, port: int, *, free_if_taken: bool = False) -> tuple[str, int]:
        """Listen on ``host:port``; the address. A port in use is an ``InvalidArgument``,
        or with ``free_if_taken`` (the default port, nobody chose it) a free one, said."""
        self._runner = web.AppRunner(
            self.app(),
            access_log=None,
            keepalive_timeout=self._request_timeout,
            lingering_time=min(self._request_timeout, 10.0),
            shutdown_timeout=_SHUTDOWN_GRACE,
        )
        await self._runner.setup()
        server = self._runner.server
        assert server is not None

        def accept() -> asyncio.BaseProtocol:
            if len(server.connections) >= self._max_connections:
                return _Refused()
            return server()

        loop = asyncio.get_running_loop()
        try:
            self._listener = await loop.create_server(accept, host, port)
        except OSError as exc:
            if not (in_use(exc) and free_if_taken):
                choose = "--http-port (0: a free one, -1: no status page)"
                raise refused("the status page", host, port, exc, choose) from None
            log.warning(
                "the status page's port %d on %s is taken (another coordinator on this "
                "host?): it is served on a free port instead",
                port,
                host,
            )
            self._listener = await loop.create_server(accept, host, 0)
        self.address = tuple(self._listener.sockets[0].getsockname()[:2])
        return self.address

    async def aclose(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()  # ends the open connections

    async def _healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        ready = self._rdzv.state in (JobState.WAITING, JobState.RUNNING)
        return web.Response(text=f"{self._rdzv.state.value}\n", status=200 if ready else 503)

    async def _status(self, request: web.Request) -> web.Response:
        try:
            offset = max(0, int(request.query.get("offset", "0")))
            limit = int(request.query.get("limit", str(API_PAGE)))
        except ValueError:
            raise web.HTTPBadRequest(text="offset and limit are whole numbers\n") from None
        body = status_json(self._rdzv, self._clock(), time.time(), offset, limit)
        return web.json_response(body)

    async def _links(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", str(API_LINKS)))
        except ValueError:
            raise web.HTTPBadRequest(text="limit is a whole number\n") from None
        return web.json_response(links_json(self._rdzv, limit, self._clock()))

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _page(self, _request: web.Request) -> web.Response:
        return web.Response(text=STATUS_PAGE, content_type="text/html")
