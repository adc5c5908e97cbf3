"""Generations as every side shows them, and the ``--nnodes`` syntax (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from shardwire.protocol.errors import InvalidArgument
from shardwire.protocol.messages import GenerationInfo


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max); raises ValueError when malformed."""
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high) if sep else int(low)
    except ValueError:
        raise InvalidArgument(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise InvalidArgument(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def describe(history: Sequence[GenerationInfo]) -> list[str]:
    """One line per generation, for summaries and ``shardwire status``."""
    lines = []
    for g in history:
        ran = "running" if g.duration_s is None else f"ran {g.duration_s:.1f} s"
        nodes = f" on {g.nodes} node{'s' * (g.nodes != 1)}" if g.nodes else ""
        end = f": {g.ended_by}" if g.ended_by else ""
        lines.append(
            f"generation {g.generation}: {g.world_size} ranks{nodes}, started "
            f"{g.started_age_s:.0f} s ago, {ran}{end}"
        )
    return lines
