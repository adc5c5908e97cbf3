"""Straggler attribution from each rank's own collective durations (no clocks shared)."""

from __future__ import annotations

import math
import random

from shardwire.coordinator.stragglers import MIN_SAMPLE, Stragglers, describe


def _collective(s: Stragglers, seq: int, spent: dict[int, int], group: int = 7) -> None:
    for rank, micros in spent.items():
        s.add(rank, [(group, len(spent), seq, micros)])


def test_the_rank_that_spends_least_arrived_last_and_others_waited_for_it() -> None:
    s = Stragglers()
    rng = random.Random(0)
    for seq in range(1, 101):
        slow = 3 if seq % 5 else rng.randrange(3)  # rank 3 is last 80 % of the time
        spent = {r: 40_000 + rng.randrange(2_000) for r in range(4)}
        spent[slow] = 500
        _collective(s, seq, spent)
    top = s.straggler()
    assert top is not None and top.rank == 3
    assert 0.79 <= top.share <= 0.81 and top.chance == 0.25
    assert 0.0402 < top.late_s < 0.0412  # the others median 41 ms, rank 3 0.5 ms
    text = describe(top, "10.0.0.4", s.matched())
    assert text == (
        "rank 3 (10.0.0.4) was last into 80% of its collectives (of the last 100), "
        "41 ms late on average"
    )


def test_ranks_arriving_together_name_nobody() -> None:
    s = Stragglers()
    rng = random.Random(1)
    for seq in range(1, 201):
        _collective(s, seq, {r: 200 + rng.randrange(50) for r in range(4)})
    assert s.matched() == 200 and s.straggler() is None  # last by chance, microseconds late


def test_two_ranks_need_more_than_chance() -> None:
    s = Stragglers()
    for seq in range(1, 101):
        # each rank last half the time, 10 ms late: that is chance for two
        slow = seq % 2
        _collective(s, seq, {slow: 100, 1 - slow: 10_100})
    assert s.straggler() is None
    for seq in range(101, 401):
        _collective(s, seq, {1: 100, 0: 10_100})
    top = s.straggler()
    assert top is not None and top.rank == 1 and top.share > 0.75


def test_matching_waits_for_every_member_and_stays_bounded() -> None:
    s = Stragglers(window=10, open_limit=5)
    s.add(0, [(1, 3, 1, 100)])
    s.add(1, [(1, 3, 1, 900)])
    assert s.matched() == 0  # rank 2 has not said yet
    s.add(2, [(1, 3, 1, 900)])
    assert s.matched() == 1 and s.ranks()[0].rank == 0
    s.add(0, [(1, 3, seq, 1) for seq in range(2, 100)])  # the others never answer
    assert s.waiting() == 5
    s.add(0, [(2, 1, 1, 5)])  # a group of one: nobody to wait for
    for seq in range(200, 230):
        _collective(s, seq, {0: 1, 1: 2_000})
    assert s.matched() == 10


def test_no_rank_is_named_before_the_minimum_sample() -> None:
    s = Stragglers()
    for seq in range(1, MIN_SAMPLE):  # rank 1 last into every one, 10 ms late
        _collective(s, seq, {1: 100, 0: 10_100})
        assert s.straggler() is None, seq
    _collective(s, MIN_SAMPLE, {1: 100, 0: 10_100})
    top = s.straggler()
    assert top is not None and top.rank == 1 and top.taken == MIN_SAMPLE


def test_the_written_down_false_alarm_rate_holds_at_the_minimum_sample() -> None:
    # a pair where each rank is last half the time: one is named by chance when it was
    # last into at least 3/4 of MIN_SAMPLE (binomial tail, either of the two ranks)
    need = -(-3 * MIN_SAMPLE // 4)
    tail = sum(math.comb(MIN_SAMPLE, i) for i in range(need, MIN_SAMPLE + 1)) / 2**MIN_SAMPLE
    assert 2 * tail < 0.0071
    # and by simulation through the class itself: 2,000 windows of fair pairs
    rng = random.Random(5)
    named = 0
    for _ in range(2000):
        s = Stragglers()
        for seq in range(1, MIN_SAMPLE + 1):
            slow = rng.randrange(2)
            _collective(s, seq, {slow: 100, 1 - slow: 10_100})
        named += s.straggler() is not None
    assert named / 2000 < 0.02, named
