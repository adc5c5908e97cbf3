"""Sizes, bus-bandwidth convention and table formatting shared by the benchmarks.

Size convention (NCCL-tests): all_reduce and broadcast move SIZE bytes per rank;
all_gather's output is SIZE bytes; reduce_scatter's input is SIZE bytes. Bus bandwidth
is algbw = SIZE / t times 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
reduce_scatter, 1 for broadcast.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SIZES = ["4K", "64K", "1M", "16M", "64M", "256M"]
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]  # timed by default
MORE_OPS = ["scan"]  # timed when asked for: torch.distributed has none (Open MPI does)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def summarize(per_iteration_max: list[float]) -> dict[str, float]:
    ordered = sorted(per_iteration_max)
    return {
        "median_s": statistics.median(ordered),
        "mean_s": sum(ordered) / len(ordered),
        "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "iters": len(ordered),
    }


def summarized(path: str) -> list[dict]:
    """The cells a timing run wrote to ``path`` (JSON), each rank-maximum time series
    replaced by its summary."""
    cells = []
    for record in json.loads(Path(path).read_text()):
        if "times" in record:
            record.update(summarize(record.pop("times")))
        cells.append(record)
    return cells
