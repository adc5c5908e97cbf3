"""What a worker reports of its peer links with its heartbeats (see
``worker/transport/traffic.py`` and ``coordinator/linktable.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shardwire.protocol.fields import Msg, Rank

_Total = Annotated[int, Field(ge=0, lt=1 << 63)]
LINKS_PER_BEAT = 64  # link reports a heartbeat carries at most (the busiest changed ones)


class LinkReport(Msg):
    """One of a worker's peer links by one path, as counted since the job's generation
    began (totals, so a lost heartbeat loses nothing): payload bytes and messages each
    way, the bytes of received payloads large enough to time and the microseconds they
    took from their header to their last byte (the link's achieved bandwidth), the rate
    of the fastest of them (bytes per second: what the link can do when neither end is
    busy), and the kernel's smoothed round-trip time of the connection (0: not
    measured)."""

    peer: Rank
    path: Literal["tcp", "shm"]
    bytes_sent: _Total = 0
    bytes_received: _Total = 0
    messages_sent: _Total = 0
    messages_received: _Total = 0
    timed_bytes: _Total = 0
    timed_us: _Total = 0
    peak_bps: _Total = 0
    rtt_us: _Total = 0
