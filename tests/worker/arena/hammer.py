"""Two processes hammering one arena's publish and wait: a writer fills its half with
the round number and publishes it, a reader waits for it, checks every word of the half
and releases it; the writer reuses a half only once it is released. Run as
``python -m tests.worker.arena.hammer DIR NAME NONCE ROUNDS PLAIN`` (the reader)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from shardwire.worker.arena.board import DONE, READY, Board
from shardwire.worker.arena.region import Geometry, Region

GEOMETRY = Geometry(2, 16 << 10)
_RUN = "hammer"
_DEADLINE = 60.0


def halves(region: Region) -> list[np.ndarray]:
    g = region.geometry
    return [np.frombuffer(region.map, np.uint32, g.half_bytes // 4, g.half(0, h)) for h in (0, 1)]


def write(region: Region, rounds: int, plain: bool) -> None:
    board, views = Board(region, 0, plain=plain), halves(region)
    deadline = time.monotonic() + _DEADLINE
    for i in range(1, rounds + 1):
        board.wait(DONE, (1,), i - 2, deadline)  # the reader is done with this half
        views[i & 1].fill(i)
        board.publish(READY, i)
    board.wait(DONE, (1,), rounds, deadline)


def read(region: Region, rounds: int, plain: bool) -> int:
    """Rounds whose half held anything but the round number when published."""
    board, views = Board(region, 1, plain=plain), halves(region)
    deadline = time.monotonic() + _DEADLINE
    torn = 0
    for i in range(1, rounds + 1):
        if not board.spin(READY, (0,), i, 20e-6, True):
            board.wait(READY, (0,), i, deadline)
        half = views[i & 1]
        torn += int(half[0] != i or half[-1] != i or not (half == i).all())
        board.publish(DONE, i)
    return torn


def main() -> None:
    directory, name, nonce, rounds, plain = sys.argv[1:6]
    region = Region.attach(_RUN, name, GEOMETRY, bytes.fromhex(nonce), Path(directory))
    print(read(region, int(rounds), plain == "1"), flush=True)


if __name__ == "__main__":
    main()
