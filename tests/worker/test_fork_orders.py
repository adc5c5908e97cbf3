"""What a node's fork server refuses of an order: one it cannot run as a rank (the
descriptors, environment and argv the agent always sends)."""

from __future__ import annotations

import pytest

from shardwire.worker.launcher.forkserver import order_problem

GOOD = {"id": 1, "env": {"RANK": "0"}, "argv": ["job.py", "--x"]}


def test_a_whole_order_with_two_descriptors_is_taken() -> None:
    assert order_problem(GOOD, [5, 6]) == ""
    assert order_problem({**GOOD, "argv": ["-m", "pkg.mod"]}, [5, 6]) == ""


@pytest.mark.parametrize(
    ("order", "fds", "said"),
    [
        (GOOD, [5], "1 descriptors came with it, not 2"),
        (GOOD, [], "0 descriptors came with it, not 2"),
        (None, [5, 6], "no environment"),
        ({**GOOD, "env": ["RANK=0"]}, [5, 6], "no environment"),
        ({**GOOD, "argv": []}, [5, 6], "no argv"),
        ({**GOOD, "argv": "job.py"}, [5, 6], "no argv"),
        ({**GOOD, "argv": ["job.py", 3]}, [5, 6], "no argv"),
    ],
)
def test_an_order_it_cannot_run_is_refused_saying_why(order, fds, said) -> None:
    assert order_problem(order, fds).startswith(said)
