"""The coordinator's clock, as a worker reads it: one probe is a query carrying the
worker's send time and a reply carrying the coordinator's time on arrival (pure).

With the round trip ``t0 -> t1`` (worker's clock) and the coordinator's time ``c`` in
between, the coordinator's clock reads ``c`` at about the midpoint, so the worker adds
``c - (t0 + t1) / 2`` to its own times; the error is at most half the round trip, and the
probe with the shortest round trip is the one kept (as NTP does).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from shardwire.protocol.fields import Msg


class ClockQuery(Msg):
    """A worker asks for the coordinator's clock (``sent``: the worker's, echoed)."""

    kind: Literal["clock_query"] = "clock_query"
    sent: float


class ClockReply(Msg):
    """The coordinator's monotonic clock when the query arrived."""

    kind: Literal["clock_reply"] = "clock_reply"
    sent: float
    now: float


def offset(probes: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """(offset to add to the worker's clock, its error bound) from probes of
    (sent, coordinator's time, received), all in seconds."""
    t0, c, t1 = min(probes, key=lambda p: p[2] - p[0])
    return c - (t0 + t1) / 2, (t1 - t0) / 2
