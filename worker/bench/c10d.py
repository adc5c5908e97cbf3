"""The same cells timed through ``torch.distributed``: over gloo (the baseline) or over
the shardwire backend (what a torch user of shardwire gets).

Run with an interpreter that has torch; for gloo this file imports nothing from shardwire,
so it runs outside shardwire's environment too:

    python c10d.py OUT.json '{"n": 2, "ops": [...], "sizes": [...], "target_s": 1.0,
                              "backend": "gloo"}'

It writes per-cell times (the slowest rank's, per iteration) as JSON. Across hosts, one
process per rank, the config also names ``rank``, ``master`` (rank 0's address), ``port``
and ``ifname`` (the interface gloo uses).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(dist, torch, op: str, nbytes: int, n: int):
    numel = nbytes // 4
    if op == "all_reduce":
        x = torch.zeros(numel, dtype=torch.float32)  # repeated in-place sums stay finite
        return lambda: dist.all_reduce(x)
    if op == "broadcast":
        x = torch.ones(numel, dtype=torch.float32)
        return lambda: dist.broadcast(x, src=0)
    if op == "all_gather":
        inp = torch.ones(numel // n, dtype=torch.float32)
        out = torch.empty(numel // n * n, dtype=torch.float32)
        # the 2.13 names where torch has them (the old ones warn on every call there)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp)
    if op == "reduce_scatter":
        inp = torch.ones(numel // n * n, dtype=torch.float32)
        out = torch.empty(numel // n, dtype=torch.float32)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp)
    if op == "scan":  # timed for shardwire and Open MPI only
        return None
    raise SystemExit(f"{__file__}: no such op {op!r}")


def _agree_max(dist, torch, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _cell(dist, torch, op: str, nbytes: int, *, n: int, target_s: float) -> dict:
    record: dict = {"op": op, "n": n, "bytes": nbytes}
    call = _call(dist, torch, op, nbytes, n)
    if call is None:
        record["error"] = f"torch.distributed has no {op}"
        return record
    try:
        call()
        start = time.perf_counter()
        call()
        first = _agree_max(dist, torch, time.perf_counter() - start)
        calibration = max(1, min(50, int(0.2 / max(first, 1e-7))))
        start = time.perf_counter()
        for _ in range(calibration):
            call()
        per = _agree_max(dist, torch, (time.perf_counter() - start) / calibration)
        iters = max(3, min(20000, int(target_s / max(per, 1e-7))))
        dist.barrier()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        mine = torch.tensor(times, dtype=torch.float64)
        everyone = [torch.zeros(iters, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(everyone, mine)
        record["times"] = torch.stack(everyone).max(dim=0).values.tolist()
    except RuntimeError as exc:  # an op this torch build lacks
        record["error"] = str(exc)[:200]
    return record


def _worker(rank: int, n: int, port: int, config: dict, out_path: str) -> None:
    master = config.get("master", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", config.get("ifname", "lo"))
    import torch
    import torch.distributed as dist

    backend = config.get("backend", "gloo")
    if backend == "shardwire":
        import shardwire.torch  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=n)
    records = [
        _cell(dist, torch, op, nbytes, n=n, target_s=config["target_s"])
        for op in config["ops"]
        for nbytes in config["sizes"]
    ]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(records, fh)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    out_path, config = sys.argv[1], json.loads(sys.argv[2])
    n = config["n"]
    if "rank" in config:  # one rank of a job across hosts
        _worker(config["rank"], n, config["port"], config, out_path)
        return
    with tempfile.TemporaryDirectory() as tmp:
        partial = os.path.join(tmp, "cells.json")
        mp.spawn(_worker, args=(n, _free_port(), config, partial), nprocs=n, join=True)
        os.replace(partial, out_path)


if __name__ == "__main__":
    main()
