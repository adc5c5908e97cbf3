"""SIGTERM as a notice to leave (live recovery with peer copies).

A spot or preemptible machine is told it will go, by SIGTERM, before it goes. Armed, a
:class:`LeaveNotice` turns that SIGTERM into a request: the process goes on until the
training loop reaches a point where every rank agrees to hand over state
(``PeerCopies.save`` at its next copy step), then leaves with ``LeftJob``. If no such
point comes within ``grace`` seconds, the process ends of SIGTERM as an unarmed one
would, so a notice nobody acts on never keeps a process alive.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading

# How long a noticed SIGTERM waits for the hand-over before the process ends of it
GRACE_S = 30.0


class LeaveNotice:
    """The process-wide SIGTERM notice of one process (see the module docstring)."""

    def __init__(self, rank: int, *, grace: float = GRACE_S) -> None:
        self.rank = rank
        self.grace = grace
        self.requested = False  # a SIGTERM arrived since the notice was armed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> bool:
        """Take SIGTERM on the running loop; False (and nothing changed) where signals
        cannot be taken: off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGTERM, self._noticed)
        return True

    def disarm(self) -> None:
        """Give SIGTERM back its default action (and drop a pending fallback)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGTERM)
        self._loop = None

    def _noticed(self) -> None:
        if self.requested or self._loop is None:
            return
        self.requested = True
        print(
            f"shardwire: rank {self.rank} got SIGTERM: it leaves at its next copy step, "
            f"after handing its state to its copy holder (at most {self.grace:g} s)",
            file=sys.stderr,
            flush=True,
        )
        self._timer = self._loop.call_later(self.grace, self._expire)

    def _expire(self) -> None:
        print(
            f"shardwire: rank {self.rank}: no copy step within {self.grace:g} s of SIGTERM; "
            "it ends without handing over its state",
            file=sys.stderr,
            flush=True,
        )
        self.disarm()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
