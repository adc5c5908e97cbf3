"""Open-file limits: the soft limit is raised towards the hard one when a job needs more
descriptors, and a hard limit below the need is one clear error before any connection."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from shardwire.protocol import DescriptorLimit
from shardwire.protocol.nofile import HEADROOM, plan_nofile

INF = resource.RLIM_INFINITY


def test_enough_already_changes_nothing() -> None:
    assert plan_nofile(4096, 8192, 1000, "x") == 4096
    assert plan_nofile(INF, INF, 10**6, "x") == INF


def test_the_soft_limit_is_raised_with_headroom_capped_by_the_hard_one() -> None:
    assert plan_nofile(1024, 1 << 20, 2112, "x") == HEADROOM
    assert plan_nofile(1024, 4096, 2112, "x") == 4096
    assert plan_nofile(1024, INF, 200_000, "x") == 200_000


def test_a_hard_limit_below_the_need_names_the_need_and_the_remedy() -> None:
    with pytest.raises(DescriptorLimit, match=r"a worker of a 1000-rank job needs 2064 .* 1024"):
        plan_nofile(256, 1024, 2064, "a worker of a 1000-rank job")


_CHILD = """
import resource, sys
from shardwire.protocol.nofile import ensure_nofile
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
try:
    ensure_nofile(int(sys.argv[3]), "this test")
except Exception as exc:
    print(type(exc).__name__, exc)
else:
    print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _child(soft: int, hard: int, needed: int) -> str:
    # a lowered hard limit cannot be raised again: only in a process of its own
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(soft), str(hard), str(needed)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.mark.e2e
def test_a_process_raises_its_own_soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != INF and hard < 2048:
        pytest.skip(f"the hard limit here is {hard}")
    assert _child(256, 2048, 1000) == "soft 2048"


@pytest.mark.e2e
def test_a_process_whose_hard_limit_is_too_low_gets_the_error() -> None:
    out = _child(128, 256, 1000)
    assert out.startswith("DescriptorLimit this test needs 1000 open files"), out
    assert "hard limit is 256" in out


@pytest.mark.e2e
def test_a_guessed_need_raises_as_far_as_the_hard_limit_allows_without_an_error() -> None:
    child = _CHILD.replace('"this test")', '"this test", strict=False)')
    out = subprocess.run(
        [sys.executable, "-c", child, "128", "256", "1000"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "soft 256"
