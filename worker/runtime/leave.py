"""SIGTERM as a notice to leave (live recovery with peer copies).

A spot or preemptible machine is told it will go, by SIGTERM, before it goes. Armed, a
:class:`LeaveNotice` turns that SIGTERM into a request: the process goes on until the
training loop reaches a point where every rank agrees to hand over state
(``PeerCopies.save`` at its next copy step), then leaves with ``LeftJob``. If no such
point comes within ``grace`` seconds, the process ends of SIGTERM as an unarmed one
would, so a notice nobody acts on never keeps a process alive.

A numpy job's notice is taken on its event loop (the main thread runs it). A torch
script's main thread runs no loop (shardwire's runs on a thread of its own): there the
notice is a plain signal handler, which Python runs on the main thread between two
bytecodes, and its grace period a timer thread the notice owns.
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

    def __init__(
        self, rank: int, *, grace: float = GRACE_S, point: str = "its next copy step"
    ) -> None:
        self.rank = rank
        self.grace = grace
        self.point = point  # where the script hands over, as the log says it
        self.requested = False  # a SIGTERM arrived since the notice was armed
        self._loop: asyncio.AbstractEventLoop | None = None  # armed on this loop
        self._timer: asyncio.TimerHandle | threading.Timer | None = None
        self._armed = False

    def arm(self) -> bool:
        """Take SIGTERM: on the running loop, or without one (a torch script) as a
        signal handler; False (and nothing changed) off the main thread, where signals
        cannot be taken."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            signal.signal(signal.SIGTERM, lambda _signum, _frame: self._noticed())
        else:
            self._loop.add_signal_handler(signal.SIGTERM, self._noticed)
        self._armed = True
        return True

    def disarm(self) -> None:
        """Give SIGTERM back its default action (and drop a pending fallback)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_signal_handler(signal.SIGTERM)
        elif self._loop is None and self._armed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._loop = None
        self._armed = False

    def _noticed(self) -> None:
        if self.requested or not self._armed:
            return
        self.requested = True
        print(
            f"shardwire: rank {self.rank} got SIGTERM: it leaves at {self.point}, "
            f"after handing its state to its copy holder (at most {self.grace:g} s)",
            file=sys.stderr,
            flush=True,
        )
        if self._loop is not None:
            self._timer = self._loop.call_later(self.grace, self._expire)
        else:
            self._timer = threading.Timer(self.grace, self._expire_off_loop)
            self._timer.daemon = True  # a process that ends first is not held up by it
            self._timer.start()

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

    def _expire_off_loop(self) -> None:
        """The timer thread's end of the grace period: SIGTERM's default action can only
        be set on the main thread, so the process ends of SIGKILL's equal instead."""
        print(
            f"shardwire: rank {self.rank}: no hand-over within {self.grace:g} s of SIGTERM; "
            "it ends without handing over its state",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signal.SIGTERM)
