"""Rank sets as runs (pure): a group of a thousand ranks is a handful of arithmetic runs
(the world, a node's ranks, a lane of every node's local rank j), so a record about it
names its members in a few numbers instead of a list that grows with the job."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Run = tuple[int, int, int]  # range(start, stop, step)


def to_runs(ranks: Iterable[int], limit: int = 32) -> list[Run] | None:
    """``ranks`` (any order, distinct) as at most ``limit`` runs, or None when they need
    more (an irregular set)."""
    ordered = sorted(ranks)
    runs: list[Run] = []
    i = 0
    while i < len(ordered):
        start = ordered[i]
        if i + 1 == len(ordered):
            runs.append((start, start + 1, 1))
            break
        step, j = ordered[i + 1] - start, i + 1
        while j + 1 < len(ordered) and ordered[j + 1] - ordered[j] == step:
            j += 1
        runs.append((start, ordered[j] + 1, step))
        if len(runs) > limit:
            return None
        i = j + 1
    return runs if len(runs) <= limit else None


def from_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    """The ranks of ``runs``, sorted."""
    out: set[int] = set()
    for start, stop, step in runs:
        out.update(range(start, stop, max(1, step)))
    return sorted(out)
