"""``shardwire coordinator --respawn N``: the coordinator as a child process, started
again on its state directory and port whenever a signal kills it, at most N times.

Where a coordinator runs as a container's main process, nothing brings it back in place
when the kernel's OOM killer or a stray ``kill`` ends it (a container restart policy
is not honoured by ``docker compose up --abort-on-container-failure``, which stops
every container instead). This process stays, and so does the container: it starts the
coordinator again, which resumes the job from its journal while the ranks train on. The
coordinator's own exit (0 finished, 1 failed, 2 refused) is final and is this process's
too. SIGTERM and SIGINT are passed on to the coordinator and end the respawning, so
stopping the container stops the job's coordinator as it would without this.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType


def respawn(argv: list[str], times: int) -> int:
    """Run the coordinator of ``argv`` (its flags) in a child, again each time a signal
    kills it, up to ``times`` more times; its exit status."""
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    command = [sys.executable, "-m", "shardwire.coordinator", *argv, "--respawn", "0"]
    code = 0
    for started in range(times + 1):
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        code = child.wait()  # as long as the job: the coordinator ends with it
        if code >= 0 or stopping:
            break
        if started < times:
            print(
                f"shardwire coordinator: killed by signal {-code}; starting it again on its "
                f"state directory ({started + 1} of {times})",
                file=sys.stderr,
                flush=True,
            )
    return code if code >= 0 else 128 - code
