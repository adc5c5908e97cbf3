"""The timing loop run inside every worker process of ``shardwire bench collectives``.

Per cell: one call to warm up, a short calibration so the cell takes about
``target_s``, a barrier, then K back-to-back calls each timed on every rank; rank 0
gathers the times and keeps, per iteration, the slowest rank's (the collective is done
when the last rank is done).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import shardwire.worker as sw
from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.bench.timing import summarize
from shardwire.worker.collectives.work import Pending
from shardwire.worker.transport import tcptuning
from shardwire.worker.transport.mesh import TcpMesh

MAX_ITERS = 20000


def make_call(pg: sw.ProcessGroup, op: str, nbytes: int) -> Callable[[], Pending[Any]]:
    n, numel = pg.world_size, nbytes // 4
    if op == "all_reduce":
        x = np.zeros(numel, np.float32)  # repeated in-place sums stay finite
        return lambda: pg.all_reduce(x)
    if op == "broadcast":
        x = np.ones(numel, np.float32)
        return lambda: pg.broadcast(x, root=0)
    if op == "all_gather":
        inp, out = np.ones(numel // n, np.float32), np.empty(numel // n * n, np.float32)
        return lambda: pg.all_gather(inp, out=out)
    if op == "reduce_scatter":
        inp, out = np.ones(numel // n * n, np.float32), np.empty(numel // n, np.float32)
        return lambda: pg.reduce_scatter(inp, out=out)
    if op == "scan":
        x = np.zeros(numel, np.float32)
        return lambda: pg.scan(x)
    raise InvalidArgument(f"unknown op {op!r}")


async def agree_max(pg: sw.ProcessGroup, value: float) -> float:
    return float((await pg.all_reduce(np.array([value]), "max"))[0])


async def measure_cell(pg: sw.ProcessGroup, op: str, nbytes: int, target_s: float) -> dict:
    call = make_call(pg, op, nbytes)
    warm = call()
    decision = warm.decision  # the backend's own, as its calls run
    await warm
    start = time.perf_counter()
    await call()
    first = await agree_max(pg, time.perf_counter() - start)
    calibration = max(1, min(50, int(0.2 / max(first, 1e-7))))
    start = time.perf_counter()
    for _ in range(calibration):
        await call()
    per = await agree_max(pg, (time.perf_counter() - start) / calibration)
    iters = max(3, min(MAX_ITERS, int(target_s / max(per, 1e-7))))
    await pg.barrier()
    times = np.empty(iters)
    clock = time.perf_counter
    for i in range(iters):
        t0 = clock()
        await call()
        times[i] = clock() - t0
    everyone = await pg.all_gather(times.reshape(1, -1))
    record: dict[str, Any] = dict(summarize(everyone.max(axis=0).tolist()))
    record.update(
        op=op,
        n=pg.world_size,
        bytes=nbytes,
        backend=decision.backend if decision else "",
        algorithm=str(decision.algorithm) if decision else "",
    )
    return record


def tcp_used(pg: sw.ProcessGroup) -> list[dict[str, object]]:
    """The TCP settings of this rank's open peer connections."""
    mesh = pg.transport
    if not isinstance(mesh, TcpMesh):
        return []
    conns = [mesh.connection(peer) for peer in mesh.peers()]
    return [tcptuning.used(c.socket) for c in conns if c is not None and c.socket]


async def run(config: dict) -> list[dict] | None:
    async with sw.init() as pg:
        records = [
            await measure_cell(pg, op, nbytes, config["target_s"])
            for op in config["ops"]
            for nbytes in config["sizes"]
        ]
        used = [u for every in await pg.all_gather_object(tcp_used(pg)) for u in every]
        for record in records:  # every value any rank's connections used, once each
            record["tcp"] = {
                k: sorted({u[k] for u in used}) for k in ("congestion", "notsent_lowat")
            }
        return records if pg.rank == 0 else None


def main() -> None:
    out_path, config = sys.argv[1], json.loads(sys.argv[2])
    records = sw.run(run(config))
    if records is not None:
        Path(out_path).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
