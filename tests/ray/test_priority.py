"""A rank's CPU priority on Ray (pure: the calls that set it are recorded, not made)."""

from __future__ import annotations

import os

import pytest

from shardwire.ray import priority


class _Host:
    """Threads at ``now``; ``allowed``: whether a thread's niceness may be lowered."""

    def __init__(self, now: int, allowed: bool) -> None:
        self.now, self.allowed = now, allowed
        self.set: dict[int, int] = {}

    def get(self, which: int, who: int) -> int:
        assert which == os.PRIO_PROCESS
        return self.set.get(who, self.now)

    def put(self, which: int, who: int, value: int) -> None:
        assert which == os.PRIO_PROCESS
        if value < self.now and not self.allowed:
            raise PermissionError(13, "Permission denied")
        self.set[who] = value


@pytest.fixture
def host(monkeypatch) -> _Host:
    def install(now: int, allowed: bool) -> _Host:
        fake = _Host(now, allowed)
        monkeypatch.setattr(priority.os, "getpriority", fake.get)
        monkeypatch.setattr(priority.os, "setpriority", fake.put)
        monkeypatch.setattr(priority, "threads", lambda: [11, 12, 13])
        return fake

    return install  # type: ignore[return-value]


def test_every_thread_of_a_rank_at_ray_s_niceness_runs_at_the_driver_s(host) -> None:
    fake = host(15, allowed=True)
    assert priority.run_at(0, rank=2) is None
    assert fake.set == {11: 0, 12: 0, 13: 0}


def test_a_rank_already_at_the_driver_s_niceness_is_left_alone(host) -> None:
    fake = host(5, allowed=False)
    assert priority.run_at(5, rank=0) is None
    assert fake.set == {}


def test_a_host_that_refuses_says_so_naming_the_rank_and_the_remedy(host) -> None:
    host(15, allowed=False)
    said = priority.run_at(0, rank=3)
    assert said is not None
    assert "rank 3 runs at niceness 15 (Ray's worker niceness), not the driver's 0" in said
    assert "RAY_worker_niceness=0" in said


def test_the_process_s_own_threads_are_listed() -> None:
    assert os.getpid() in priority.threads()  # the main thread's id is the process id
