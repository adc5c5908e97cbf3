"""The torch tests' ranks, forked from one server per test process (``forked.py``): each
exits with its own code and output, and one still running at the timeout is ended."""

from __future__ import annotations

import os
import sys

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from shardwire.worker.bench import BenchmarkFailed  # noqa: E402
from shardwire.worker.bench.torchrun import run_ranks  # noqa: E402

from . import forked  # noqa: E402

pytestmark = pytest.mark.e2e

PROGRAM = """
import os, signal, sys, time
import torch
rank = int(os.environ["RANK"])
print("rank", rank, "of", os.environ["WORLD_SIZE"], "pid", os.getpid(), "session", os.getsid(0))
print("argv", sys.argv[1:], "torch ready", torch.ones(2).sum().item())
if sys.argv[1] == "sleep" and rank == 1:
    time.sleep(600)
if sys.argv[1] == "kill" and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(rank * 3)
"""


def test_each_forked_rank_ends_with_its_own_code_output_and_session(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    ranks = run_ranks(3, [sys.executable, str(program), "exit"], logs=tmp_path, start=forked.start)
    assert ranks.codes == [0, 3, 6]
    for rank, out in enumerate(ranks.outs):
        words = out.split()
        assert words[:4] == ["rank", str(rank), "of", "3"]
        assert words[5] == words[7]  # each leads a session of its own, as a new process
        assert "argv ['exit'] torch ready 2.0" in out
    killed = run_ranks(
        2, [sys.executable, str(program), "kill"], logs=tmp_path / "k", start=forked.start
    )
    assert killed.codes == [0, -9]  # as subprocess gives a signal's end


def test_a_rank_still_running_at_the_timeout_is_ended_and_named(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    argv = [sys.executable, str(program), "sleep"]
    with pytest.raises(BenchmarkFailed, match="did not finish in 3 s"):
        run_ranks(2, argv, logs=tmp_path, timeout=3, start=forked.start)
    pid = int((tmp_path / "rank1.out").read_text().split()[5])
    with pytest.raises(ProcessLookupError):  # killed and reaped by its server
        os.kill(pid, 0)
