"""Reading the coordinator's clock from a worker: the probe with the shortest round trip
wins, and the offset is right within half of it."""

from __future__ import annotations

import random

import pytest

from shardwire.protocol.clock import ClockQuery, ClockReply, offset
from shardwire.protocol.messages import decode_message, encode_message


@pytest.mark.parametrize("true_offset", [-1234.5, 0.0, 0.25, 987654.321])
def test_offset_within_half_the_shortest_round_trip(true_offset: float) -> None:
    rng = random.Random(7)
    probes = []
    t = 100.0
    for _ in range(20):
        out, back = rng.uniform(1e-5, 5e-3), rng.uniform(1e-5, 5e-3)  # one-way delays
        probes.append((t, t + out + true_offset, t + out + back))
        t += 0.01
    got, error = offset(probes)
    best = min(p[2] - p[0] for p in probes)
    assert error == pytest.approx(best / 2)
    assert abs(got - true_offset) <= error + 1e-9


def test_clock_messages_round_trip() -> None:
    for msg in (ClockQuery(sent=1.5), ClockReply(sent=1.5, now=99.25)):
        assert decode_message(encode_message(msg)) == msg
