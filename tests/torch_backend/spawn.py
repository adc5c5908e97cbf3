"""The test programs, started as torch ranks or under ``shardwire launch``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from shardwire.worker.bench.torchrun import Ranks, clean_env
from shardwire.worker.bench.torchrun import run_ranks as _run_ranks

from . import forked

PROGS = Path(__file__).resolve().parent / "progs"
SHARDWIRE = str(Path(sys.executable).parent / "shardwire")


def run_ranks(n: int, prog: str, *args: str, tmp: Path, timeout: float = 240.0) -> Ranks:
    """``progs/PROG ARGS`` as ``n`` ranks started the way torchrun starts them, but forked
    from a server that imported torch (``forked.py``)."""
    argv = [sys.executable, str(PROGS / prog), *args]
    return _run_ranks(n, argv, logs=tmp, timeout=timeout, start=forked.start)


def launch(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """``shardwire launch --standalone ARGS``."""
    return subprocess.run(
        [SHARDWIRE, "launch", "--standalone", *args],
        check=False,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
