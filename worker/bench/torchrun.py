"""Starting torch ranks the way torchrun does, for benchmarks and tests: torch's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) on loopback, rank 0 serving torch's TCPStore."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from shardwire.worker.bench import BenchmarkFailed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without a shardwire job's variables, one thread per
    rank (as torchrun sets it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
    return {**base, "OMP_NUM_THREADS": "1", **extra}


@dataclass
class Ranks:
    """Exit codes, standard output and standard error of each rank, in rank order."""

    codes: list[int]
    outs: list[str]
    errs: list[str]

    def check(self) -> Ranks:
        """Raise, with each failed rank's error output, unless every rank exited 0."""
        if any(self.codes):
            detail = "\n".join(
                f"--- rank {r} (exit {c})\n{e[-3000:]}"
                for r, (c, e) in enumerate(zip(self.codes, self.errs, strict=True))
            )
            raise BenchmarkFailed(f"ranks failed: {self.codes}\n{detail}")
        return self


class Started(Protocol):
    """A rank's process as :func:`run_ranks` watches it (``subprocess.Popen`` is one)."""

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...


def popen(argv: list[str], env: dict[str, str], out: BinaryIO, err: BinaryIO) -> Started:
    """A rank started as torchrun starts one: a new interpreter."""
    return subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)


Start = Callable[[list[str], dict[str, str], BinaryIO, BinaryIO], Started]


def run_ranks(
    n: int, argv: list[str], *, logs: Path, timeout: float = 600.0, start: Start = popen
) -> Ranks:
    """``argv`` as ``n`` ranks, each started by ``start`` (a new interpreter unless told);
    output goes to files in ``logs``. Every process has ended when this returns: those
    still running at ``timeout`` are killed, then it raises."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[Started] = []
    files = []
    for rank in range(n):
        out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
        env = clean_env(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        with out.open("wb") as o, err.open("wb") as e:
            procs.append(start(argv, env, o, e))
        files.append((out, err))
    deadline = time.monotonic() + timeout
    codes: list[int] = []
    try:
        codes = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    texts = [(o.read_text(errors="replace"), e.read_text(errors="replace")) for o, e in files]
    if not codes:
        tails = "\n".join(f"--- rank {r}\n{e[-2000:]}" for r, (_, e) in enumerate(texts))
        raise BenchmarkFailed(f"{argv} did not finish in {timeout:.0f} s:\n{tails}")
    return Ranks(codes, [o for o, _ in texts], [e for _, e in texts])
