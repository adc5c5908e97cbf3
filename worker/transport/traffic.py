"""What this rank moved (pure): its totals, and what each peer link carried: payload
bytes and messages each way, by path.

A link is a peer and a path: ``tcp`` (frames on the connection) or ``shm`` (payloads
through the pair's shared-memory segment, announced on the connection). Counts are
totals since the transport started, so the coordinator just keeps the newest report and
a lost heartbeat loses nothing. Two further figures say how good a link is:

- achieved bandwidth, from received TCP payloads of at least ``TIMED_BYTES``: the time
  from their header to their last byte. Smaller payloads arrive in one read and would
  only measure the loop.
- round-trip time, the kernel's smoothed estimate for the connection (``TCP_INFO``),
  sampled by :func:`kernel_rtt_us` at most once per ``RTT_EVERY`` seconds of sending.

Ranks of one node moving collectives through their node arena do not appear here: the
arena is one region per node, not a link per pair (their bytes are in the rank totals).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Literal

from shardwire.protocol.linkreports import LINKS_PER_BEAT, LinkReport

Path = Literal["tcp", "shm"]
TIMED_BYTES = 256 * 1024  # received payloads this large are timed (several reads each)
RTT_EVERY = 0.5  # seconds between two round-trip samples of one connection
_TCPI_RTT = 68  # offset of tcpi_rtt (microseconds) in Linux's struct tcp_info
_TCP_INFO = getattr(socket, "TCP_INFO", None)


@dataclass(slots=True)
class TransportStats:
    """Bytes and messages moved by this rank, by every path (payload bytes only)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


@dataclass(slots=True)
class LinkCounters(TransportStats):
    """One link's totals, and whether they moved since the last report."""

    timed_bytes: int = 0
    timed_us: int = 0
    peak_bps: int = 0  # the fastest timed payload's rate
    rtt_us: int = 0
    reported_bytes: int = 0  # bytes both ways at the last report
    changed: bool = False


_REPORTED = tuple(name for name in LinkReport.model_fields if name not in ("peer", "path"))


class Traffic:
    """Every link of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self._links: dict[tuple[int, Path], LinkCounters] = {}

    def _link(self, peer: int, path: Path) -> LinkCounters:
        link = self._links.get((peer, path))
        if link is None:
            link = self._links[(peer, path)] = LinkCounters()
        return link

    def sent(self, peer: int, path: Path, nbytes: int) -> None:
        link = self._link(peer, path)
        link.bytes_sent += nbytes
        link.messages_sent += 1
        link.changed = True

    def received(self, peer: int, path: Path, nbytes: int, seconds: float | None = None) -> None:
        """A message arrived; ``seconds``: how long its payload took, if it was timed."""
        link = self._link(peer, path)
        link.bytes_received += nbytes
        link.messages_received += 1
        if seconds is not None and nbytes >= TIMED_BYTES:
            micros = max(1, round(seconds * 1e6))
            link.timed_bytes += nbytes
            link.timed_us += micros
            link.peak_bps = max(link.peak_bps, nbytes * 1_000_000 // micros)
        link.changed = True

    def round_trip(self, peer: int, micros: int) -> None:
        link = self._link(peer, "tcp")
        if micros != link.rtt_us:
            link.rtt_us = micros
            link.changed = True

    def report(self, limit: int = LINKS_PER_BEAT) -> list[LinkReport]:
        """The links that moved since the last report, those that moved most first (at
        most ``limit``; the others stay due for the next report)."""
        due = [(key, link) for key, link in self._links.items() if link.changed]
        due.sort(key=lambda kv: kv[1].reported_bytes - kv[1].bytes_sent - kv[1].bytes_received)
        reports = []
        for (peer, path), link in due[:limit]:
            link.changed = False
            link.reported_bytes = link.bytes_sent + link.bytes_received
            totals = {name: getattr(link, name) for name in _REPORTED}
            reports.append(LinkReport(peer=peer, path=path, **totals))
        return reports

    def get(self, peer: int, path: Path = "tcp") -> LinkCounters | None:
        """The totals of one link (None: it carried nothing yet)."""
        return self._links.get((peer, path))


def kernel_rtt_us(sock: socket.socket | None) -> int:
    """The kernel's smoothed round-trip time of a TCP socket in microseconds (0 where
    the platform does not tell or the socket is gone)."""
    if sock is None or _TCP_INFO is None:
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCPI_RTT + 4)
    except OSError:
        return 0
    if len(info) < _TCPI_RTT + 4:
        return 0
    return int(struct.unpack_from("I", info, _TCPI_RTT)[0])
