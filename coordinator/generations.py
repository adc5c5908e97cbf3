"""A job's generations: the number, the restart budget and the history
(pure: times are the inputs' clock).

A generation is one formed world: its members and their ranks. It ends when
every rank finishes, when a rank fails, or when the membership changes. A failure opens
the next generation while restarts remain (``max_restarts``); a membership change within
``--nnodes MIN:MAX`` always does and uses no restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwire.protocol.messages import HISTORY_SHOWN, GenerationInfo

_HISTORY = 1024  # generations kept (the oldest are dropped past this)


@dataclass(slots=True)
class Era:
    """One generation's record."""

    generation: int
    world_size: int
    nodes: int
    started: float
    ended: float | None = None
    ended_by: str = ""


@dataclass(slots=True)
class Generations:
    """The current generation number, the restart budget and every generation so far."""

    max_restarts: int = 0
    restarts: int = 0
    current: int = 1  # being formed, or running
    eras: list[Era] = field(default_factory=list)

    @property
    def restarts_left(self) -> int:
        return max(0, self.max_restarts - self.restarts)

    def begin(self, world_size: int, nodes: int, now: float) -> None:
        self.eras.append(Era(self.current, world_size, nodes, now))
        del self.eras[:-_HISTORY]

    def end(self, cause: str, now: float) -> None:
        """Close the running generation (if one runs) with its cause."""
        if self.eras and self.eras[-1].ended is None and self.eras[-1].generation == self.current:
            self.eras[-1].ended = now
            self.eras[-1].ended_by = cause

    def advance(self, *, failure: bool) -> None:
        """Open the next generation; a failure uses one restart."""
        self.current += 1
        if failure:
            self.restarts += 1

    def info(self, now: float, *, upto: int | None = None) -> list[GenerationInfo]:
        """The history as sent to agents and status clients (``upto``: exclusive): the
        first generation and the latest ones, HISTORY_SHOWN in all."""
        eras = [e for e in self.eras if upto is None or e.generation < upto]
        if len(eras) > HISTORY_SHOWN:
            eras = [eras[0], *eras[len(eras) - HISTORY_SHOWN + 1 :]]
        return [
            GenerationInfo(
                generation=e.generation,
                world_size=e.world_size,
                nodes=e.nodes,
                started_age_s=round(max(0.0, now - e.started), 3),
                duration_s=None if e.ended is None else round(e.ended - e.started, 3),
                ended_by=e.ended_by,
            )
            for e in eras
        ]
