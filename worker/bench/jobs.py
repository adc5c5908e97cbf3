"""Running a benchmark script as a ``shardwire launch --standalone`` job."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.bench import BenchmarkFailed


def command_line(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``shardwire bench NAME``, described by the first paragraph of
    the benchmark's docstring ``doc``, with its usage lines as the examples."""
    text = (doc or "").strip()
    first = " ".join(text.split("\n\n")[0].split())
    lines = [line.strip() for line in text.splitlines()]
    examples = [line for line in lines if line.startswith(f"shardwire bench {name}")]
    return argparse.ArgumentParser(
        prog=f"shardwire bench {name}",
        description=first,
        epilog="examples:\n" + "\n".join(f"  {e}" for e in examples or [f"shardwire bench {name}"]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def rank_side(out: str, work: Coroutine[Any, Any, Any]) -> None:
    """A benchmark job's rank: run ``work`` (its coroutine) and, on rank 0 (the one whose
    result is not None), write the result as JSON to ``out``."""
    from shardwire.worker import run

    result = run(work)
    if result is not None:
        Path(out).write_text(json.dumps(result))


def side_python(requested: str | None, venv: str, probe: str) -> str | None:
    """``requested``, else this interpreter, else ``~/.cache/<venv>/bin/python``: the
    first that can run ``probe``."""
    candidates = (
        [requested]
        if requested
        else [sys.executable, str(Path.home() / f".cache/{venv}/bin/python")]
    )
    for python in candidates:
        if python and (shutil.which(python) or Path(python).exists()):
            found = subprocess.run([python, "-c", probe], capture_output=True, check=False)
            if found.returncode == 0:
                return python
    return None


def example(name: str) -> Path:
    """``examples/NAME`` of the shardwire checkout this runs in (the benchmarks that train
    the examples need one: the examples are not part of the package)."""
    path = Path.cwd() / "examples" / name
    if not path.is_file():
        raise InvalidArgument(
            f"{path} does not exist: run this benchmark from a shardwire checkout "
            "(the directory holding examples/)"
        )
    return path


def run_job(
    module: str, nproc: int, *args: str, timeout: float = 3600, env: dict[str, str] | None = None
) -> Any:
    """Run ``python -m MODULE --worker OUT ARGS`` on ``nproc`` local workers (with ``env``
    added to the environment); return the JSON rank 0 wrote to OUT (see :func:`rank_side`;
    a fresh temporary directory, removed afterwards, is OUT's parent and is also passed as
    ``SHARDWIRE_BENCH_DIR`` for scratch files)."""
    shardwire = str(Path(sys.executable).parent / "shardwire")
    with tempfile.TemporaryDirectory(prefix="shardwire-bench-") as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run(
            [
                shardwire,
                "launch",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                "-m",
                module,
                "--worker",
                str(out),
                *args,
            ],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), "SHARDWIRE_BENCH_DIR": tmp},
        )
        return json.loads(out.read_text())


def coordinator_port(port_file: Path, coordinator: subprocess.Popen, limit: float = 60) -> int:
    """The port a benchmark's coordinator wrote to ``port_file`` (waits up to ``limit`` s;
    raises if it exits first)."""
    deadline = time.monotonic() + limit
    while not port_file.exists() or not port_file.read_text().strip():
        if coordinator.poll() is not None or time.monotonic() > deadline:
            raise BenchmarkFailed("the benchmark's coordinator did not start")
        time.sleep(0.02)
    return int(port_file.read_text())


def run_nodes(
    target: list[str],
    nproc: int,
    nodes: int,
    env: dict[str, str],
    *,
    timeout: float = 3600,
    hosts: list[tuple[list[str], str]] | None = None,
) -> None:
    """Run ``target`` (``-m MODULE ARGS``, or a script and its arguments) as one job of
    ``nproc`` workers on ``nodes`` nodes: a
    coordinator and one ``shardwire worker`` agent per node, each with its own node id
    (shared memory inside a node, TCP across). The nodes are simulated on this host, or
    are ``hosts``: per node, a command prefix that runs inside it and its address (the
    coordinator runs in the first)."""
    if nproc % nodes:
        raise InvalidArgument(f"{nproc} workers do not split evenly over {nodes} nodes")
    where = hosts or [([], "127.0.0.1")] * nodes
    cli = [sys.executable, "-m", "shardwire.worker.launcher.cli"]
    env = {**env, "SHARDWIRE_TOKEN": secrets.token_hex(16)}
    with tempfile.TemporaryDirectory(prefix="shardwire-bench-") as tmp:
        port_file = Path(tmp) / "port"
        first, bind = where[0]
        coordinator = subprocess.Popen(
            [
                *first,
                *cli,
                "coordinator",
                "--host",
                bind,
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--world-size",
                str(nproc),
                "--http-port",
                "-1",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        agents: list[subprocess.Popen] = []
        try:
            address = f"{bind}:{coordinator_port(port_file, coordinator)}"
            agents = [
                subprocess.Popen(
                    [
                        *where[i][0],
                        *cli,
                        "worker",
                        "--coordinator",
                        address,
                        "--nnodes",
                        str(nodes),
                        "--nproc-per-node",
                        str(nproc // nodes),
                        "--node-id",
                        f"node-{i}",
                        *target,
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                )
                for i in range(nodes)
            ]
            for agent in agents:
                if agent.wait(timeout=timeout) != 0:
                    raise subprocess.CalledProcessError(agent.returncode, agent.args)
        finally:
            for proc in [*agents, coordinator]:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
