"""A rank under a node agent ends with its agent.

The agent is what supervises a node's ranks: it starts a failed one again, stops them
all when the job ends, and stands for the node at the coordinator. An agent that dies
(SIGKILL, its machine going) loses the node; a rank left running without it (an orphan)
could otherwise join the next generation in the place of the rank the node's next agent
starts, and two processes would claim one rank. Linux ends a process when its parent
does if asked (``PR_SET_PDEATHSIG``): a rank asks for SIGKILL, then checks that its
parent did not die before it asked. A forked rank's parent is its node's fork server,
which asks the same of its agent, so the rank ends with the agent all the same.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def end_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when ``parent`` (its parent's pid) ends; if
    that parent is already gone, end now. False where the kernel cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # it died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)
    return True
