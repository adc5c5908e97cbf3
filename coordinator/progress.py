"""The job's progress over time, for the status views (pure).

Rank 0's heartbeats carry its step, the run's total steps where the script knows them,
its training loss, its latest held-out loss, its throughput and the share of its time
spent waiting for collectives. :class:`Curves` keeps a bounded history of each, and
estimates the time left from the recent pace: the steps rank 0 made over the last
PACE_WINDOW_S seconds (at least two heartbeats apart), applied to the steps left. An
estimate needs a total and a pace; before both, there is none (never a guess).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shardwire.protocol.beats import Progress

POINTS = 2000  # kept per curve (a heartbeat a second: over half an hour at full detail)
PACE_WINDOW_S = 60.0  # the pace is measured over at most this much recent time


@dataclass(frozen=True)
class Pace:
    """A throughput point: when (the coordinator's clock), which step, how fast."""

    time: float
    step: int
    samples_per_s: float
    comm_share: float | None


@dataclass
class Curves:
    """Rank 0's training loss, held-out loss and throughput over the running job."""

    total_steps: int = 0  # 0: the script has not said
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=POINTS))
    held_out: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=POINTS))
    pace: deque[Pace] = field(default_factory=lambda: deque(maxlen=POINTS))

    def add(self, now: float, before: Progress, beat: Progress) -> None:
        """Rank 0's heartbeat ``beat`` at ``now`` (``before``: its previous one)."""
        if beat.total_steps:
            self.total_steps = beat.total_steps
        if beat.loss is not None and beat.loss != before.loss:
            self.losses.append((beat.step, beat.loss))
        if beat.held_out is not None and beat.held_out != before.held_out:
            self.held_out.append((beat.step, beat.held_out))
        if beat.step != before.step or not self.pace:
            self.pace.append(Pace(now, beat.step, beat.samples_per_s, beat.comm_share))

    def eta_s(self, now: float) -> float | None:
        """Seconds until the last step at the recent pace; None without a total or a
        pace (fewer than two points, or no step made over the window)."""
        if not self.total_steps or len(self.pace) < 2:
            return None
        last = self.pace[-1]
        first = next(p for p in self.pace if p.time >= last.time - PACE_WINDOW_S)
        if first is last:
            first = self.pace[-2]
        steps, seconds = last.step - first.step, last.time - first.time
        if steps <= 0 or seconds <= 0:
            return None
        left = max(0, self.total_steps - last.step)
        return max(0.0, left * seconds / steps - (now - last.time))

    def view(self, now: float, wall: float) -> dict:
        """The curves for ``/api/status`` (times as wall-clock seconds)."""
        last = self.pace[-1].step if self.pace else 0
        eta = self.eta_s(now)
        return {
            "progress": {
                "step": last,
                "total_steps": self.total_steps or None,
                "eta_s": None if eta is None else round(eta, 1),
            },
            "losses": [{"step": s, "loss": loss} for s, loss in self.losses],
            "held_out": [{"step": s, "loss": loss} for s, loss in self.held_out],
            "throughput": [
                {
                    "time": wall - (now - p.time),
                    "step": p.step,
                    "samples_per_s": p.samples_per_s,
                    "comm_share": p.comm_share,
                }
                for p in self.pace
            ],
        }
