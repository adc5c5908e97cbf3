"""Starting torch ranks the way torchrun does (torch's variables, rank 0's TCPStore)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROGS = Path(__file__).resolve().parent / "progs"
SHARDWIRE = str(Path(sys.executable).parent / "shardwire")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without shardwire's job variables, one thread each."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWIRE_")}
    return {**base, "OMP_NUM_THREADS": "1", **extra}


@dataclass
class Ranks:
    codes: list[int]
    outs: list[str]
    errs: list[str]

    def check(self) -> Ranks:
        if any(self.codes):
            detail = "\n".join(
                f"--- rank {r} (exit {c})\n{e[-3000:]}"
                for r, (c, e) in enumerate(zip(self.codes, self.errs, strict=True))
            )
            raise AssertionError(f"ranks failed: {self.codes}\n{detail}")
        return self


def run_ranks(n: int, prog: str, *args: str, tmp: Path, timeout: float = 240.0) -> Ranks:
    """``prog ARGS`` as ``n`` ranks on loopback; every process is ended by the deadline."""
    port = free_port()
    procs, files = [], []
    for rank in range(n):
        out, err = tmp / f"rank{rank}.out", tmp / f"rank{rank}.err"
        env = clean_env(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        with out.open("w") as o, err.open("w") as e:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(PROGS / prog), *args],
                    env=env,
                    stdout=o,
                    stderr=e,
                    stdin=subprocess.DEVNULL,
                )
            )
        files.append((out, err))
    deadline = time.monotonic() + timeout
    try:
        codes = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        codes = []
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    if not codes:
        errs = "\n".join(e.read_text()[-2000:] for _, e in files)
        raise AssertionError(f"{prog} did not finish in {timeout:.0f} s:\n{errs}")
    return Ranks(codes, [o.read_text() for o, _ in files], [e.read_text() for _, e in files])


def launch(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """``shardwire launch --standalone ARGS`` (paths of ``progs`` resolved by the caller)."""
    return subprocess.run(
        [SHARDWIRE, "launch", "--standalone", *args],
        check=False,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
