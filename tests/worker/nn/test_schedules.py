"""Pipeline schedules as orders of passes: every pass once, a backward after its forward,
no deadlock when every rank waits for what it needs, and the bubble theory predicts:
(p - 1) / (m + p - 1) for 1F1B, (p - 1) / (v m + p - 1) interleaved."""

from __future__ import annotations

import pytest

from shardwire.worker.nn.schedules import bubble, order, picture, timeline

CASES = [
    ("gpipe", 2, 4, 1),
    ("1f1b", 2, 1, 1),
    ("1f1b", 2, 8, 1),
    ("1f1b", 4, 3, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved", 2, 2, 2),
    ("interleaved", 2, 8, 2),
    ("interleaved", 4, 8, 2),
    ("interleaved", 4, 8, 4),
    ("interleaved", 3, 6, 3),
]


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_every_pass_runs_once_and_a_backward_follows_its_forward(schedule, p, m, v) -> None:
    for rank in range(p):
        ops = order(schedule, p, rank, m, v)
        assert sorted(ops) == sorted(
            (kind, c, i) for kind in "FB" for c in range(v) for i in range(m)
        )
        assert all(ops.index(("F", c, i)) < ops.index(("B", c, i)) for _, c, i in ops)


@pytest.mark.parametrize("schedule, p, m, v", CASES)
def test_the_simulated_bubble_is_the_theoretical_one(schedule, p, m, v) -> None:
    slots = timeline(schedule, p, m, v)  # raises if the ranks' orders deadlock
    theory = (p - 1) / (v * m + p - 1)
    if schedule == "gpipe":
        theory = (p - 1) / (m + p - 1)
    assert bubble(slots) == pytest.approx(theory)


def test_interleaving_shrinks_the_bubble() -> None:
    assert bubble(timeline("interleaved", 2, 8, 2)) < bubble(timeline("1f1b", 2, 8)) / 1.8


def test_the_picture_shows_each_pass_and_the_idle_time() -> None:
    assert picture(timeline("1f1b", 2, 4)) == "rank 0  ab..AAcBBdCC.DD\nrank 1  .aAAbBBcCCdDD.."
    drawn = picture(timeline("interleaved", 2, 4, 2)).splitlines()
    assert [len(line) for line in drawn] == [8 + 27] * 2  # 27 time units: 8 F, 16 B, 3 idle
    assert drawn[0].count(".") + drawn[1].count(".") == 6
