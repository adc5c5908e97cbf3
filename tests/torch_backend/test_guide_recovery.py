"""The torch guide's recovery sample, run as written: DDP and FSDP2 on 2 ranks under
``--recovery live``, rank 1 SIGKILLed from outside mid-run. The survivor keeps its
process, the replacement takes the state from the peers' memory (``PeerStorage``), and
the held-out loss equals the run without the failure, bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from shardwire.worker.bench.torchrun import clean_env  # noqa: E402
from tests.docblocks import block  # noqa: E402

from .spawn import SHARDWIRE, launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

LIVE = ("--max-restarts", "1", "--recovery", "live")


def _final(text: str) -> str:
    found = re.search(r"final loss (\S+)", text)
    assert found, text[-3000:]
    return found.group(1)


def _killed_mid_run(script: Path, *args: str, at_step: int = 12) -> tuple[str, int]:
    """Run the sample, SIGKILL rank 1 once it reports ``at_step``; its output, and the
    killed process id."""
    argv = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", *LIVE, str(script)]
    proc = subprocess.Popen(
        [*argv, *args],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    victim = 0
    deadline = time.monotonic() + 240
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            seen = re.search(rf"rank 1 pid (\d+) step {at_step} ", line)
            if seen and not victim:
                victim = int(seen.group(1))
                os.kill(victim, signal.SIGKILL)
            assert time.monotonic() < deadline, "".join(lines[-50:])
        assert proc.wait(60) == 0, "".join(lines[-50:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert victim, "".join(lines[-50:])
    return "".join(lines), victim


@pytest.mark.parametrize("wrap", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_the_guide_s_sample_trains_on_through_a_killed_rank(tmp_path: Path, wrap: list[str]):
    script = tmp_path / "train.py"
    script.write_text(block("torch-recovery").text)
    straight = launch("--nproc-per-node", "2", str(script), *wrap)
    assert straight.returncode == 0, straight.stderr[-3000:]
    text, victim = _killed_mid_run(script, *wrap)
    assert _final(text) == _final(straight.stdout + straight.stderr)
    pids = {r: set(re.findall(rf"rank {r} pid (\d+) step", text)) for r in (0, 1)}
    said = [line for line in text.splitlines() if "[agent]" in line or "Error" in line]
    assert len(pids[0]) == 1 and len(pids[1]) == 2 and str(victim) in pids[1], (pids, said)
    assert "started anew, forked" in text
    # both went on from the newest checkpoint the peers held (or the one before, when the
    # kill came as the newest was saved), not from step 0; the survivor in its process
    last = max(_steps(text, victim))
    (again,) = pids[1] - {str(victim)}
    first = _steps(text, int(again))[0]
    assert first % 5 == 0 and max(5, last - 9) <= first <= last + 1, (last, first)
    (kept,) = pids[0]
    survivor = _steps(text, int(kept))
    # where the survivor started again (or went on): its last time at that step
    turn = len(survivor) - 1 - survivor[::-1].index(first)
    assert survivor == [*range(turn), *range(first, 40)] and turn >= first, survivor


def _steps(text: str, pid: int) -> list[int]:
    """The steps process ``pid`` trained, in order."""
    return [int(s) for s in re.findall(rf"rank \d pid {pid} step (\d+) ", text)]
