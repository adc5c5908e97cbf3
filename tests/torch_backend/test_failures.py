"""A dead rank ends a torch job with the rank named, never a hang."""

from __future__ import annotations

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from .spawn import PROGS, launch, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_a_killed_rank_is_named_by_the_launcher(tmp_path):
    done = launch("--nproc-per-node", "2", "--max-restarts", "0", str(PROGS / "die.py"))
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert "first failure on this node: rank 1" in text, text[-3000:]
    assert "SIGKILL" in text


def test_a_killed_rank_fails_the_others_wait_with_its_rank(tmp_path):
    ranks = run_ranks(3, "die.py", tmp=tmp_path)
    assert ranks.codes[1] == -9
    for r in (0, 2):
        assert ranks.codes[r] == 1
        assert "PeerFailed: rank 1 failed" in ranks.errs[r], ranks.errs[r][-2000:]


def test_every_way_to_read_a_failed_call_raises_on_every_survivor(tmp_path):
    ranks = run_ranks(3, "failed_calls.py", tmp=tmp_path)
    assert ranks.codes[1] == -9
    ways = {
        "wait": "PeerFailed",
        "wait(timeout)": "PeerFailed",
        "exception": "PeerFailed",
        # torch's C++ side fails the future; Python's wait raises what torch makes of it
        "get_future": "RuntimeError",
        "then": "RuntimeError",
        "collect_all": "RuntimeError",
        "blocking": "PeerFailed",
    }
    for r in (0, 2):
        assert ranks.codes[r] == 3, ranks.errs[r][-2000:]
        for way, kind in ways.items():
            line = f"ok {way}: {kind}: "
            assert line in ranks.outs[r], (way, ranks.outs[r], ranks.errs[r][-2000:])
            said = ranks.outs[r].split(line)[1].splitlines()[0]
            named = "rank 1 failed" if kind == "PeerFailed" else "PeerFailed: rank 1 failed"
            assert named in said, (way, said)


def test_a_mismatched_collective_is_caught_on_every_rank(tmp_path):
    ranks = run_ranks(2, "mismatch.py", tmp=tmp_path)
    assert ranks.codes == [3, 3], ranks.errs
    for out in ranks.outs:
        assert "mismatch:" in out and "all_reduce" in out, out


def test_the_timeout_given_to_init_process_group_bounds_a_collective(tmp_path):
    ranks = run_ranks(2, "timeout.py", "4", tmp=tmp_path)
    assert ranks.codes[0] == 3, ranks.errs[0][-2000:]
    out = ranks.outs[0]
    seconds = float(out.split("timed out after ")[1].split(" s")[0])
    assert 3.5 <= seconds < 12, out  # the 4 s limit, not SHARDWIRE_TIMEOUT's 300 s
    assert "not heard from ranks [1]" in out, out  # the late rank is named
