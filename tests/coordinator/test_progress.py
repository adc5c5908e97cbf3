"""Rank 0's progress over time for the status views: the curves kept, and the time left
estimated from the recent pace, only once there is a total and a pace."""

from __future__ import annotations

import pytest

from shardwire.coordinator.progress import PACE_WINDOW_S, POINTS, Curves
from shardwire.protocol.beats import Progress


def _feed(curves: Curves, beats: list[tuple[float, Progress]]) -> None:
    before = Progress()
    for now, beat in beats:
        curves.add(now, before, beat)
        before = beat


def test_the_time_left_follows_the_recent_pace() -> None:
    curves = Curves()
    # 10 steps a second for 30 s, then 2 steps a second for PACE_WINDOW_S
    beats = [(t, Progress(step=10 * t, total_steps=1000)) for t in range(31)]
    beats += [
        (30 + t, Progress(step=300 + 2 * t, total_steps=1000))
        for t in range(1, int(PACE_WINDOW_S) + 1)
    ]
    _feed(curves, beats)
    now, step = beats[-1][0], beats[-1][1].step
    assert curves.eta_s(now) == pytest.approx((1000 - step) / 2)  # the slow pace only
    assert curves.eta_s(now + 10) == pytest.approx((1000 - step) / 2 - 10)  # time passes
    view = curves.view(now, wall=1e9)
    assert view["progress"] == {"step": step, "total_steps": 1000, "eta_s": (1000 - step) / 2}


def test_no_estimate_without_a_total_or_a_pace() -> None:
    curves = Curves()
    _feed(curves, [(t, Progress(step=t)) for t in range(5)])
    assert curves.eta_s(5) is None and curves.view(5, 5)["progress"]["total_steps"] is None
    stuck = Curves()
    _feed(stuck, [(0, Progress(step=3, total_steps=9)), (1, Progress(step=3, total_steps=9))])
    assert stuck.eta_s(1) is None  # one point: no pace
    _feed(stuck, [(2, Progress(step=4, total_steps=9))])
    assert stuck.eta_s(2) == pytest.approx(10.0)  # 1 step in 2 s, 5 left


def test_losses_held_out_and_throughput_are_kept_as_they_change() -> None:
    curves = Curves()
    _feed(
        curves,
        [
            (0, Progress(step=1, loss=2.0, samples_per_s=10, comm_share=0.5)),
            (1, Progress(step=1, loss=2.0, samples_per_s=10, comm_share=0.5)),  # repeated beat
            (2, Progress(step=2, loss=1.5, held_out=1.9, samples_per_s=12, comm_share=0.25)),
            (3, Progress(step=3, loss=1.2, held_out=1.9, samples_per_s=14)),
        ],
    )
    view = curves.view(3, wall=103)
    assert view["losses"] == [{"step": s, "loss": v} for s, v in ((1, 2.0), (2, 1.5), (3, 1.2))]
    assert view["held_out"] == [{"step": 2, "loss": 1.9}]
    assert [
        (p["time"], p["step"], p["samples_per_s"], p["comm_share"]) for p in view["throughput"]
    ] == [(100, 1, 10, 0.5), (102, 2, 12, 0.25), (103, 3, 14, None)]


def test_the_curves_are_bounded() -> None:
    curves = Curves()
    _feed(curves, [(t, Progress(step=t, loss=1.0 / (t + 1))) for t in range(POINTS + 50)])
    assert len(curves.losses) == len(curves.pace) == POINTS
