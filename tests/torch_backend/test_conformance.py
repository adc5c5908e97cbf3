"""The shardwire backend against torch's gloo backend, call by call: every c10d function
it serves, for every dtype and reduce op, on the world and on a subgroup, waited at once
and through handles, must give what gloo gives (``progs/conformance.py``)."""

from __future__ import annotations

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from .spawn import run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _summary(out: str) -> dict[str, int]:
    (line,) = [s for s in out.splitlines() if s.startswith("checks ")]
    words = line.split()
    return {words[i]: int(words[i + 1]) for i in range(0, len(words), 2)}


@pytest.mark.long(25)
@pytest.mark.parametrize("n", [2, 4])
def test_every_call_gives_what_gloo_gives(n, tmp_path):
    ranks = run_ranks(n, "conformance.py", tmp=tmp_path, timeout=480).check()
    diffs = [line for out in ranks.outs for line in out.splitlines() if line.startswith("diff ")]
    assert not diffs, f"{len(diffs)} differences from gloo:\n" + "\n".join(diffs[:60])
    for rank, out in enumerate(ranks.outs):
        seen = _summary(out)
        # the whole matrix ran on every rank: calls both served, calls both refused, and
        # calls only shardwire serves (each checked against gloo's way to the same result)
        assert seen["checks"] >= 2700, (rank, seen)
        assert seen["refused"] >= 790 and seen["extensions"] >= 660, (rank, seen)
        assert seen["diffs"] == 0, (rank, seen)
