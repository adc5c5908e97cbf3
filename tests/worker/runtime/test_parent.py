"""A rank under a node agent ends with its agent: a child that asked (end_with_parent)
dies with its SIGKILLed parent, and one whose parent is already gone ends at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(120)
"""
CHILD = """
import os, time
from shardwire.worker.runtime.parent import end_with_parent
assert end_with_parent(os.getppid())
print("asked", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_that_asked_dies_with_its_sigkilled_parent() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        # the parent's line and the child's, in the order they came (either may be first)
        lines = sorted(parent.stdout.readline().strip() for _ in range(2))
        assert lines[1] == "asked", lines
        child = int(lines[0])
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)


def test_a_process_whose_parent_is_already_gone_ends_at_once() -> None:
    code = "from shardwire.worker.runtime.parent import end_with_parent\n"
    code += "end_with_parent(1 << 30)\nprint('still here')\n"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == -signal.SIGKILL and "still here" not in done.stdout
