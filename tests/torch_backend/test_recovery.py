"""Live recovery of a torch job: FSDP2 ranks that survive a rank's death re-form the
default group in their processes (``shardwire.torch.recovering``), reload the newest
``torch.distributed.checkpoint``, and end with the parameters of a run without the
failure, bit for bit."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch", reason="torch is not installed (`make torch` installs its CPU build)")

from .spawn import PROGS, launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _final(text: str) -> str:
    found = re.search(r"final ([0-9a-f]{64})", text)
    assert found, text[-3000:]
    return found.group(1)


def test_fsdp2_survivors_re_form_in_their_processes_and_end_as_without_the_failure(tmp_path):
    prog = str(PROGS / "reform.py")
    straight = launch("--nproc-per-node", "4", prog, str(tmp_path / "a"), "16", "-1")
    assert straight.returncode == 0, straight.stderr[-3000:]
    live = ("--max-restarts", "1", "--recovery", "live")
    run = launch("--nproc-per-node", "4", *live, prog, str(tmp_path / "b"), "16", "10")
    assert run.returncode == 0, run.stderr[-3000:]
    text = run.stdout + run.stderr
    assert _final(text) == _final(straight.stdout + straight.stderr)
    pids = {r: re.findall(rf"rank {r} pid (\d+) trains", text) for r in range(4)}
    assert all(len(p) == 2 for p in pids.values()), text[-3000:]
    # the survivors kept their processes; rank 1's was replaced (it died at step 10)
    assert [len(set(pids[r])) for r in range(4)] == [1, 2, 1, 1]
    assert text.count("resumes at step 8") == 4  # the newest checkpoint before step 10
