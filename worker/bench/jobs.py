"""Running a benchmark script as a ``shardwire launch --standalone`` job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_job(script: str, nproc: int, *args: str, timeout: float = 3600) -> Any:
    """Run ``script --worker OUT ARGS`` on ``nproc`` local workers; return the JSON rank 0
    wrote to OUT (a fresh temporary directory, removed afterwards, is OUT's parent and
    is also passed as ``SHARDWIRE_BENCH_DIR`` for scratch files)."""
    shardwire = str(Path(sys.executable).parent / "shardwire")
    with tempfile.TemporaryDirectory(prefix="shardwire-bench-") as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run(
            [shardwire, "launch", "--standalone", "--nproc-per-node", str(nproc), script,
             "--worker", str(out), *args],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "SHARDWIRE_BENCH_DIR": tmp},
        )  # fmt: skip
        return json.loads(out.read_text())
