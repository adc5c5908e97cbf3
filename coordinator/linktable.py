"""The job's peer links as the ranks report them, and the one that is slow (pure).

Every rank sends, with its heartbeats, the totals of the links that moved (see
``worker/transport/traffic.py``): per peer and path, bytes and messages each way, the
bytes of large received payloads and how long they took, and the connection's smoothed
round-trip time. The table keeps each rank's newest totals, so a directed link src → dst
reads its bytes from src's report and its achieved bandwidth from dst's (the receiver
times the payloads).

A link is named slow when its figure is far from the other links' median: a peak rate at
most 1 / SLOW_FACTOR of it (over links that timed at least TIMED_MIN bytes), or a round
trip at least SLOW_FACTOR times it and SLOW_RTT_S longer (over links that carried at least
TIMED_MIN bytes: the kernel's estimate for a connection that carries a few small
messages swings with delayed acknowledgements and with its processes' scheduling; a
busy 2-core host showed 1.7 ms against a median of 0.2 ms on loopback). It takes at least
MIN_LINKS measured links to have a median worth comparing with. The peak rate is the
fastest timed payload's: a link that is slow is slow every time, while a payload the
receiver took long to read because its loop or its core was busy elsewhere (a loaded
host, ranks sharing an event loop) says nothing about the link, and the average
bandwidth (shown) would count it. TIMED_MIN is several large payloads, so a peak is
the best of several tries: on a loop that serves several connections at once, one
payload can be read late every time it arrives alongside another.

Memory is bounded: a rank's links beyond PER_RANK are not kept (ranks talk to O(log n)
peers), and the whole table holds at most LINKS rows. The views (every link, sorted, and
the slow one) are computed at most once per REFRESH_S of the readers' clock while
reports keep arriving, so status pages, scrapes and their pages share one computation
however busy the heartbeats are.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardwire.protocol.linkreports import LinkReport

PER_RANK = 256  # links kept per reporting rank
LINKS = 1 << 16  # links kept in all
SLOW_FACTOR = 4.0
SLOW_RTT_S = 0.005  # a round trip must also be this much above the median to count
TIMED_MIN = 8 << 20  # bytes a link must have timed before its peak rate is compared
MIN_LINKS = 3
REFRESH_S = 1.0  # the views lag the newest report by at most this (one heartbeat)


@dataclass(frozen=True)
class Link:
    """A directed link src → dst by one path, as both ends reported it."""

    src: int
    dst: int
    path: str
    bytes: int  # payload bytes src sent to dst
    messages: int
    bandwidth: float | None  # bytes per second dst measured receiving (None: not timed)
    peak: float | None  # the fastest timed payload's bytes per second (None: not timed)
    rtt_s: float | None  # the connection's round trip, the larger of both ends' readings


@dataclass(frozen=True)
class SlowLink:
    """A link far below (bandwidth) or above (round trip) the others' median."""

    link: Link
    what: str  # "bandwidth" (the peak rate) or "round trip"
    value: float
    median: float
    links: int  # the links the median was taken over


class LinkTable:
    """The newest link reports of every rank of the running generation."""

    def __init__(self, per_rank: int = PER_RANK, limit: int = LINKS) -> None:
        self._rows: dict[int, dict[tuple[int, str], LinkReport]] = {}
        self._per_rank, self._limit, self._size = per_rank, limit, 0
        self._view: tuple[list[Link], SlowLink | None] = ([], None)
        self._dirty = False  # reports arrived since the view was computed
        self._view_at = float("-inf")  # when it was computed

    def add(self, rank: int, reports: Iterable[LinkReport]) -> None:
        """``rank``'s newest totals."""
        rows = self._rows.setdefault(rank, {})
        for report in reports:
            key = (report.peer, report.path)
            if key not in rows:
                if len(rows) >= self._per_rank or self._size >= self._limit:
                    continue
                self._size += 1
            rows[key] = report
        self._dirty = True

    def _current(self, now: float | None) -> tuple[list[Link], SlowLink | None]:
        if self._dirty and (now is None or now >= self._view_at + REFRESH_S):
            links = self._directed()
            self._view, self._dirty = (links, _slowest(links)), False
            self._view_at = float("-inf") if now is None else now
        return self._view

    def __len__(self) -> int:
        return self._size

    def _report(self, rank: int, peer: int, path: str) -> LinkReport | None:
        return self._rows.get(rank, {}).get((peer, path))

    def links(self, now: float | None = None) -> list[Link]:
        """Every directed link that carried bytes, most bytes first (as of at most
        REFRESH_S before ``now``; None: as of now)."""
        return self._current(now)[0]

    def slow(self, now: float | None = None) -> SlowLink | None:
        """The link furthest from the others' median, if one is far enough (see the
        module docstring); bandwidth is weighed before round trips."""
        return self._current(now)[1]

    def _directed(self) -> list[Link]:
        found = []
        for src, rows in self._rows.items():
            for (dst, path), out in rows.items():
                if out.bytes_sent == 0:
                    continue
                into = self._report(dst, src, path)
                rate = _bandwidth(into)
                found.append(
                    Link(
                        src=src,
                        dst=dst,
                        path=path,
                        bytes=out.bytes_sent,
                        messages=out.messages_sent,
                        bandwidth=rate,
                        peak=None if rate is None or into is None else float(into.peak_bps),
                        rtt_s=self._rtt(src, dst),
                    )
                )
        return sorted(found, key=lambda link: (-link.bytes, link.src, link.dst, link.path))

    def _rtt(self, a: int, b: int) -> float | None:
        readings = [
            r.rtt_us
            for r in (self._report(a, b, "tcp"), self._report(b, a, "tcp"))
            if r and r.rtt_us
        ]
        return max(readings) / 1e6 if readings else None


def _slowest(links: list[Link]) -> SlowLink | None:
    rates = [(link, link.peak) for link in links if link.peak]
    by_rate = _outlier(rates, "bandwidth")
    if by_rate is not None:
        return by_rate
    busy = [k for k in links if k.rtt_s is not None and k.bytes >= TIMED_MIN]
    pairs = {(min(k.src, k.dst), max(k.src, k.dst)): k for k in busy}
    return _outlier([(k, k.rtt_s) for k in pairs.values() if k.rtt_s is not None], "round trip")


def _bandwidth(report: LinkReport | None) -> float | None:
    if report is None or report.timed_bytes < TIMED_MIN or report.timed_us <= 0:
        return None
    return report.timed_bytes / (report.timed_us / 1e6)


def _outlier(figures: list[tuple[Link, float]], what: str) -> SlowLink | None:
    """The link whose figure is furthest from the median the wrong way, if far enough."""
    if len(figures) < MIN_LINKS:
        return None
    median = statistics.median(value for _, value in figures)
    if what == "bandwidth":
        link, value = min(figures, key=lambda f: f[1])
        far = value * SLOW_FACTOR <= median
    else:
        link, value = max(figures, key=lambda f: f[1])
        far = value >= SLOW_FACTOR * median and value - median >= SLOW_RTT_S
    return SlowLink(link, what, value, median, len(figures)) if far else None


def describe(slow: SlowLink, host: Callable[[int], str]) -> str:
    """The line the status views show (``host``: a rank's host)."""
    link = slow.link
    a, b = f"rank {link.src} ({host(link.src)})", f"rank {link.dst} ({host(link.dst)})"
    if slow.what == "bandwidth":
        figure = f"at most {_rate(slow.value)} against a median of {_rate(slow.median)}"
        return f"link {a} -> {b} ({link.path}) is slow: {figure} over {slow.links} links"
    figure = f"{slow.value * 1e3:.1f} ms against a median of {slow.median * 1e3:.2f} ms"
    return f"link {a} <-> {b} is slow: round trip {figure} over {slow.links} links"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.1f} MB/s"
