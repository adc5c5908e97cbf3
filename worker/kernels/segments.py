"""How arrays are cut into segments and pipeline chunks (pure arithmetic)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """Split ``total`` items into ``parts`` contiguous ranges, the first ones one larger."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def offsets(sizes: list[int]) -> list[tuple[int, int]]:
    """Ranges for explicit sizes."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def pipeline_depth(segment_bytes: int, *, chunk_bytes: int, max_depth: int) -> int:
    """How many chunks to cut a segment into so transfers and reductions overlap."""
    return max(1, min(max_depth, math.ceil(segment_bytes / chunk_bytes)))


def sub(range_: tuple[int, int], parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` sub-ranges of ``range_``."""
    start, stop = range_
    lo, hi = bounds(stop - start, parts)[index]
    return start + lo, start + hi


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def paired(n: int) -> bool:
    """Whether a group of ``n`` pairs its ranks by XOR (r with r ^ 2^k) in the
    logarithmic algorithms: when n is a power of two."""
    return n & (n - 1) == 0


def node_layout(nodes: Sequence[Hashable]) -> list[list[int]] | None:
    """Group ranks (indices into ``nodes``, each rank's node id) by node, nodes in order of
    their lowest rank; None unless there are several nodes and one of them holds two or
    more ranks (else nothing moves inside a node and the flat algorithms apply)."""
    by_node: dict[Hashable, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    layout = list(by_node.values())
    if len(layout) < 2 or max(len(ranks) for ranks in layout) < 2:
        return None
    return layout
