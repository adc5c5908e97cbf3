"""Every c10d collective over the shardwire backend, checked against numpy on each rank.

    python collectives.py INIT   (INIT: env | tcp | file:PATH | store | cpu)

Started by the tests with torch's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Every rank builds every rank's inputs (they depend on the rank only), so each result is
checked against its numpy oracle locally. Prints ``checks N`` when all passed.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

import shardwire.torch  # noqa: F401  (registers the backend)

CHECKS = 0


def same(got: torch.Tensor, want: np.ndarray, what: str, tol: float = 0.0) -> None:
    global CHECKS
    g = got.detach().float().numpy() if got.dtype == torch.bfloat16 else got.detach().numpy()
    if g.shape != want.shape or not np.allclose(g, want, rtol=tol, atol=tol):
        raise AssertionError(
            f"rank {dist.get_rank()}: {what}: got {g.tolist()}, want {want.tolist()}"
        )
    CHECKS += 1


def data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    base = torch.arange(n, dtype=torch.float64) * 0.5 + rank * 3 + 1
    return base.to(dtype)


def init(kind: str) -> None:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if kind == "env":
        dist.init_process_group("shardwire")
    elif kind == "cpu":
        dist.init_process_group("cpu:shardwire")
    elif kind == "tcp":
        dist.init_process_group(
            "shardwire", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size
        )
    elif kind.startswith("file:"):
        dist.init_process_group(
            "shardwire", init_method=f"file://{kind[5:]}", rank=rank, world_size=size
        )
    elif kind == "store":
        store = dist.TCPStore(addr, port, size, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("shardwire", store=store, rank=rank, world_size=size)
    else:
        raise SystemExit(f"unknown init {kind}")


def reductions(r: int, n: int) -> None:
    ranks = range(n)
    for dtype, tol in [
        (torch.float32, 1e-6),
        (torch.float64, 0),
        (torch.int64, 0),
        (torch.float16, 1e-3),
        (torch.bfloat16, 1e-2),
    ]:
        t = data(r, 7, dtype)
        dist.all_reduce(t)
        want = sum(data(k, 7, dtype).double().numpy() for k in ranks)
        same(t.double(), want, f"all_reduce sum {dtype}", tol * want.max())
    for op, fn in [
        (dist.ReduceOp.MAX, np.maximum.reduce),
        (dist.ReduceOp.MIN, np.minimum.reduce),
        (dist.ReduceOp.PRODUCT, np.multiply.reduce),
    ]:
        t = data(r, 5, torch.int32)
        dist.all_reduce(t, op=op)
        same(t, fn([data(k, 5, torch.int32).numpy() for k in ranks]), f"all_reduce {op}")
    for op, fn in [
        (dist.ReduceOp.BAND, np.bitwise_and.reduce),
        (dist.ReduceOp.BOR, np.bitwise_or.reduce),
        (dist.ReduceOp.BXOR, np.bitwise_xor.reduce),
    ]:
        t = torch.tensor([r + 1, 7 - r, 12 * r + 5], dtype=torch.int64)
        dist.all_reduce(t, op=op)
        same(t, fn([np.array([k + 1, 7 - k, 12 * k + 5]) for k in ranks]), f"all_reduce {op}")
    t = data(r, 6, torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    same(
        t,
        np.mean([data(k, 6, torch.float32).numpy() for k in ranks], axis=0),
        "all_reduce avg",
        1e-6,
    )
    t = data(r, 6, torch.float32)
    premul = dist._make_nccl_premul_sum(0.25)
    if hasattr(premul, "factor"):  # torch >= 2.13 shows the factor to a Python backend
        dist.all_reduce(t, op=premul)
        want = 0.25 * sum(data(k, 6, torch.float32).numpy() for k in ranks)
        same(t, want, "all_reduce premul_sum", 1e-5)
    else:
        try:
            dist.all_reduce(t, op=premul)
        except ValueError as exc:
            assert "PREMUL_SUM" in str(exc), exc
        else:
            raise AssertionError("PREMUL_SUM without a factor was not refused")
    # a non-contiguous tensor goes through a staging copy and comes back in place
    m = data(r, 12, torch.float32).reshape(3, 4).t()
    dist.all_reduce(m)
    same(
        m,
        sum(data(k, 12, torch.float32).numpy() for k in ranks).reshape(3, 4).T,
        "all_reduce transposed",
    )


def rooted_and_scattered(r: int, n: int) -> None:
    ranks = range(n)
    t = data(r, 4, torch.float32)
    dist.reduce(t, dst=n - 1)
    if r == n - 1:
        same(t, sum(data(k, 4, torch.float32).numpy() for k in ranks), "reduce")
    else:
        same(t, data(r, 4, torch.float32).numpy(), "reduce leaves a non-root's input")
    # reduce_scatter: list form, single-tensor form, and both torch method generations
    inputs = [data(r * 10 + p, 3, torch.float32) for p in ranks]
    out = torch.empty(3)
    dist.reduce_scatter(out, inputs)
    same(out, sum(data(k * 10 + r, 3, torch.float32).numpy() for k in ranks), "reduce_scatter")
    pg = dist.distributed_c10d._get_default_group()
    for name in ("reduce_scatter_single", "_reduce_scatter_base"):
        src = data(r, 2 * n, torch.float32)
        out = torch.empty(2)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        getattr(pg, name)(out, src, opts).wait()
        want = np.mean([data(k, 2 * n, torch.float32).numpy() for k in ranks], axis=0)[
            2 * r : 2 * r + 2
        ]
        same(out, want, f"{name} avg", 1e-6)
    outs = [torch.empty(2), torch.empty(1)]
    srcs = [data(r, 2 * n, torch.float32), data(r, n, torch.float32)]
    pg.reduce_scatter_single_coalesced(outs, srcs, dist.ReduceScatterOptions()).wait()
    for o, k in zip(outs, (2, 1), strict=True):
        total = sum(data(q, k * n, torch.float32).numpy() for q in ranks)
        same(o, total[k * r : k * r + k], "reduce_scatter coalesced")
    ts = [data(r, 3, torch.float32), data(r, 2, torch.float64)]
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
    same(ts[1], sum(data(k, 2, torch.float64).numpy() for k in ranks), "allreduce coalesced")


def movement(r: int, n: int) -> None:
    ranks = range(n)
    root = n - 1
    t = data(r, 5, torch.bfloat16)
    dist.broadcast(t, src=root)
    same(t, data(root, 5, torch.bfloat16).float().numpy(), "broadcast bf16")
    outs = [torch.empty(3, dtype=torch.int64) for _ in ranks]
    dist.all_gather(outs, data(r, 3, torch.int64))
    for k in ranks:
        same(outs[k], data(k, 3, torch.int64).numpy(), "all_gather list")
    pg = dist.distributed_c10d._get_default_group()
    for name in ("all_gather_single", "_allgather_base"):
        out = torch.empty(2 * n)
        getattr(pg, name)(out, data(r, 2, torch.float32), AllgatherOptions()).wait()
        same(out, np.concatenate([data(k, 2, torch.float32).numpy() for k in ranks]), name)
    out = torch.empty(n, 2)
    dist.all_gather_into_tensor(out, data(r, 2, torch.float32))
    same(
        out, np.stack([data(k, 2, torch.float32).numpy() for k in ranks]), "all_gather_into_tensor"
    )
    outs = [torch.empty(3 * n), torch.empty(n)]
    pg.all_gather_single_coalesced(
        outs, [data(r, 3, torch.float32), data(r, 1, torch.float32)], AllgatherOptions()
    ).wait()
    same(
        outs[0],
        np.concatenate([data(k, 3, torch.float32).numpy() for k in ranks]),
        "all_gather coalesced",
    )
    # all_to_all: equal and uneven splits (rank r sends p+1 rows of 2 to rank p)
    src = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    out = torch.empty(n * 2)
    dist.all_to_all_single(out, src)
    same(
        out,
        np.concatenate([np.arange(2 * r, 2 * r + 2) + 100.0 * k for k in ranks]),
        "all_to_all_single",
    )
    send = [p + 1 for p in ranks]
    rows = sum(send)
    src = (torch.arange(rows * 2, dtype=torch.float32) + 1000 * r).reshape(rows, 2)
    out = torch.empty(n * (r + 1), 2)
    dist.all_to_all_single(out, src, output_split_sizes=[r + 1] * n, input_split_sizes=send)
    start = sum(range(1, r + 1))
    want = np.concatenate(
        [(np.arange(rows * 2) + 1000.0 * k).reshape(rows, 2)[start : start + r + 1] for k in ranks]
    )
    same(out, want, "all_to_all_single uneven")
    outs = [torch.empty(2) for _ in ranks]
    dist.all_to_all(outs, [torch.full((2,), float(10 * r + p)) for p in ranks])
    for k in ranks:
        same(outs[k], np.full(2, 10.0 * k + r), "all_to_all list")
    gathered = [torch.empty(2) for _ in ranks] if r == root else None
    dist.gather(data(r, 2, torch.float32), gather_list=gathered, dst=root)
    if gathered is not None:
        for k in ranks:
            same(gathered[k], data(k, 2, torch.float32).numpy(), "gather")
    out = torch.empty(3)
    dist.scatter(
        out, [data(p + 50, 3, torch.float32) for p in ranks] if r == root else None, src=root
    )
    same(out, data(r + 50, 3, torch.float32).numpy(), "scatter")


def point_to_point(r: int, n: int) -> None:
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(4)
    if r % 2 == 0:
        dist.send(data(r, 4, torch.float32), right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(data(r, 4, torch.float32), right)
    same(got, data(left, 4, torch.float32).numpy(), "send/recv")
    out = torch.empty(4)
    works = [dist.isend(data(r + 7, 4, torch.float32), right, tag=3), dist.irecv(out, left, tag=3)]
    for w in works:
        w.wait()
    same(out, data(left + 7, 4, torch.float32).numpy(), "isend/irecv")
    # receives from any source: rank 0 hears every other rank once, each one named
    if r == 0:
        heard = []
        for _ in range(n - 1):
            buf = torch.empty(4)
            src = dist.recv(buf, tag=9)
            same(buf, data(src + 20, 4, torch.float32).numpy(), "recv from any source")
            heard.append(src)
        assert sorted(heard) == list(range(1, n)), heard
    else:
        dist.send(data(r + 20, 4, torch.float32), 0, tag=9)
    # ... and in a subgroup, where torch turns the group rank it gets into a global one
    sub = dist.new_group(list(range(1, n)))
    if n > 2 and r == n - 1:
        buf = torch.empty(2)
        src = dist.recv(buf, group=sub, tag=4)
        assert src == 1, src
        same(buf, data(1, 2, torch.float32).numpy(), "recv from any source in a subgroup")
    elif n > 2 and r == 1:
        dist.send(data(1, 2, torch.float32), n - 1, group=sub, tag=4)


def asynchronous(r: int, n: int) -> None:
    t = data(r, 3, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    work.wait()
    want = sum(data(k, 3, torch.float32).numpy() for k in range(n))
    same(doubled.wait(), 2 * want, "future.then")
    assert work.is_completed()
    # a started call moves while the caller computes (here: sleeps, holding no GIL), as
    # DDP's bucket all-reduces must during backward: it completes before any wait()
    big = torch.ones(1 << 20)
    work = dist.all_reduce(big, async_op=True)
    for _ in range(600):
        if work.is_completed():
            break
        time.sleep(0.05)
    assert work.is_completed(), "a started all_reduce made no progress without wait()"
    same(big[:4], np.full(4, float(n)), "progress without wait")
    dist.barrier()
    # torch lets only gloo through dist.monitored_barrier; the group's method is there
    dist.distributed_c10d._get_default_group().monitored_barrier(timedelta(seconds=60))
    # wait(timeout) is honoured: rank 0 gives up early, then the call completes anyway
    late = torch.ones(2)
    if r != 0:
        time.sleep(2.0)
    work = dist.all_reduce(late, async_op=True)
    if r == 0:
        try:
            work.wait(timeout=timedelta(milliseconds=200))
        except TimeoutError as exc:
            assert "wait(timeout=0.2 s)" in str(exc), exc
            same(torch.ones(1), np.ones(1), "wait(timeout) raised")
        else:
            raise AssertionError("wait(timeout) returned before the others arrived")
    work.wait()
    same(late, np.full(2, float(n)), "the late call still completed")


def groups(r: int, n: int) -> None:
    evens = list(range(0, n, 2))
    sub = dist.new_group(evens)
    if r in evens:
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=sub)
        same(t, np.full(2, float(sum(evens))), "new_group all_reduce")
        assert sub.group_name, "a subgroup has a name"
    if n % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("a", "b"))
        t = torch.full((1,), float(r))
        dist.all_reduce(t, group=mesh.get_group("b"))
        row = [q for q in range(n) if q // (n // 2) == r // (n // 2)]
        same(t, np.full(1, float(sum(row))), "device mesh dimension group")


def main() -> None:
    init(sys.argv[1])
    r, n = dist.get_rank(), dist.get_world_size()
    backend = "cpu:shardwire" if sys.argv[1] == "cpu" else "shardwire"  # as init named it
    assert dist.get_backend() == backend, (dist.get_backend(), backend)
    reductions(r, n)
    rooted_and_scattered(r, n)
    movement(r, n)
    point_to_point(r, n)
    asynchronous(r, n)
    groups(r, n)
    dist.destroy_process_group()
    print(f"checks {CHECKS}", flush=True)


if __name__ == "__main__":
    main()
