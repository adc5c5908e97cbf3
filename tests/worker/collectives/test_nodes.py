"""Collectives in tiers over several nodes: results against numpy, bytes across nodes
counted, and the order of concurrent calls.

Nodes are simulated by roster node ids (a node arena inside each node, TCP across).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest

from shardwire.worker.backends import ops
from shardwire.worker.collectives import Group, ReduceOp
from shardwire.worker.kernels.segments import node_layout
from tests.worker.transport.fabric import tcp_world

from .test_oracle import check, data, oracle
from .worlds import on_all

# node of each rank: contiguous 2x2, 2 nodes x 3, 3 nodes x 2, and interleaved 2x2
LAYOUTS = {
    "2x2": [0, 0, 1, 1],
    "2x3": [0, 0, 0, 1, 1, 1],
    "3x2": [0, 0, 1, 1, 2, 2],
    "interleaved": [0, 1, 0, 1],
}
COUNT = 400_003  # float32: large enough for the ring algorithms on the lanes


@contextlib.asynccontextmanager
async def node_world(nodes: list[int]) -> AsyncIterator[tuple[list[Group], list[list]]]:
    """Groups over simulated nodes, and per rank the (destination, bytes) of each send."""
    async with tcp_world(len(nodes), shm=True, arena=True, nodes=nodes, timeout=30.0) as meshes:
        sent: list[list] = [[] for _ in meshes]
        for mesh, log in zip(meshes, sent, strict=True):
            send = mesh.send

            async def recording(dst, array, *, _send=send, _log=log, **kw):
                _log.append((dst, array.nbytes))
                return await _send(dst, array, **kw)

            mesh.send = recording  # type: ignore[method-assign]
        groups = [Group(m, timeout=30.0) for m in meshes]
        try:
            yield groups, sent
        finally:
            for g in groups:
                await g.aclose()


def across(nodes: list[int], sent: list[list], rank: int) -> int:
    return sum(b for dst, b in sent[rank] if nodes[dst] != nodes[rank])


async def checked_all_reduces(
    name: str, groups: list[Group], sent: list[list], cases: list[tuple[str, ReduceOp]], count: int
) -> AsyncIterator[np.ndarray]:
    """For each (dtype, op) of ``cases``: an all_reduce of ``count`` elements on every
    rank, checked against numpy and bit-identical on every rank. Yields rank 0's input,
    with ``sent`` holding that call's sends only."""
    n = len(groups)
    for salt, (dtype, op) in enumerate(cases):
        for log in sent:
            log.clear()
        inputs = [data(r, count, dtype, salt) for r in range(n)]
        outs = await on_all(groups, lambda g: g.all_reduce(inputs[g.rank].copy(), op))
        want = oracle(inputs, op)
        for r, got in enumerate(outs):
            check(got, want, f"{name} {dtype} {op} rank {r}")
        assert all(o.tobytes() == outs[0].tobytes() for o in outs)
        yield inputs[0]


def test_layout_needs_several_nodes_and_one_with_company() -> None:
    assert node_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert node_layout(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert node_layout(["a", "a", "a"]) is None  # one node
    assert node_layout(["a", "b", "c"]) is None  # one rank per node
    assert node_layout(["a", "a", "b"]) == [[0, 1], [2]]  # uneven: through the leaders


async def test_a_group_over_nodes_decides_tiers_for_four_ops_and_links_for_the_rest() -> None:
    async with node_world(LAYOUTS["2x2"]) as (groups, _sent):
        x = np.ones(1 << 18, np.float32)
        for g in groups:
            assert g.backend.name == "tiered"
        g = groups[0]
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            for n in (4, 1 << 18):
                assert str(g.backend.decide(_descriptor(op, x[:n], g))) == "tiered/tiers"
        reduce = ops.Reduce.of(x, "sum", 0, None, size=4)
        assert str(g.backend.decide(reduce)) == "links/ring"
        assert str(g.backend.decide(ops.Scan.of(x, "sum", None))) == "links/doubling"


def _descriptor(op: str, x: np.ndarray, g) -> object:
    if op == "all_reduce":
        return ops.AllReduce.of(x, "sum", None)
    if op == "all_gather":
        return ops.AllGather.of(x, None, None, size=g.size, rank=g.rank)
    if op == "reduce_scatter":
        return ops.ReduceScatter.of(x, "sum", None, None, size=g.size, rank=g.rank)
    return ops.Broadcast.of(x, 0, size=g.size)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
async def test_all_reduce_crosses_nodes_once_per_lane(name: str) -> None:
    nodes = LAYOUTS[name]
    n, k = len(nodes), len(set(nodes))
    local = n // k
    async with node_world(nodes) as (groups, sent):
        assert len(groups[0].backend.layout) == k
        cases = [("float32", ReduceOp.SUM), ("float32", ReduceOp.AVG), ("int64", ReduceOp.MAX)]
        async for first in checked_all_reduces(name, groups, sent, cases, COUNT):
            nbytes = first.nbytes
            expected = 2 * (k - 1) / k * nbytes / local
            for r in range(n):  # a flat ring would send 2(n-1)/n of it over each link
                assert across(nodes, sent, r) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
async def test_reduce_scatter_and_all_gather_over_nodes(name: str) -> None:
    nodes = LAYOUTS[name]
    n, k = len(nodes), len(set(nodes))
    sizes = [COUNT // n + 3 * r for r in range(n)]  # uneven parts
    async with node_world(nodes) as (groups, sent):
        inputs = [data(r, sum(sizes), "float32", 7) for r in range(n)]
        outs = await on_all(groups, lambda g: g.reduce_scatter(inputs[g.rank], sizes=sizes))
        want = oracle(inputs, ReduceOp.SUM)
        cut = np.cumsum([0, *sizes])
        for r, got in enumerate(outs):
            check(got, want[cut[r] : cut[r + 1]], f"{name} reduce_scatter rank {r}")
        # each rank's part crosses to it from each other node once, as a partial sum
        crossing = sum(across(nodes, sent, r) for r in range(n))
        assert crossing == (k - 1) * inputs[0].nbytes
        for log in sent:
            log.clear()
        parts = [data(r, sizes[r], "int32", 9) for r in range(n)]
        outs = await on_all(groups, lambda g: g.all_gather(parts[g.rank], sizes=sizes))
        for r, got in enumerate(outs):
            check(got, np.concatenate(parts), f"{name} all_gather rank {r}")
        # every part reaches each other node once
        crossing = sum(across(nodes, sent, r) for r in range(n))
        assert crossing == (k - 1) * sum(p.nbytes for p in parts)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("root", [0, 3])
async def test_broadcast_crosses_to_each_node_once(name: str, root: int) -> None:
    nodes = LAYOUTS[name]
    n, k = len(nodes), len(set(nodes))
    async with node_world(nodes) as (groups, sent):
        x = data(root, COUNT, "float32", 11)
        bufs = [x.copy() if r == root else np.zeros_like(x) for r in range(n)]
        outs = await on_all(groups, lambda g: g.broadcast(bufs[g.rank], root=root))
        for r, got in enumerate(outs):
            check(got, x, f"{name} broadcast root {root} rank {r}")
        crossing = sum(across(nodes, sent, r) for r in range(n))
        assert crossing == (k - 1) * x.nbytes


async def test_each_node_moves_its_share_through_its_arena() -> None:
    nodes = LAYOUTS["2x2"]
    async with node_world(nodes) as (groups, sent):
        inputs = [data(r, 1000, "float32", 3) for r in range(4)]
        await on_all(groups, lambda g: g.all_reduce(inputs[g.rank].copy()))  # opens the arenas
        for log in sent:
            log.clear()
        outs = await on_all(groups, lambda g: g.all_reduce(inputs[g.rank].copy()))
        for r, got in enumerate(outs):
            check(got, oracle(inputs, ReduceOp.SUM), f"rank {r}")
        for g in groups:
            assert g.backend.name == "tiered"
            gate = g.backend.local.backend.gate
            assert gate is not None and gate.arena is not None, "the node phases left the arena"
            assert g.backend.across.backend.name == "links"  # lanes cross nodes: TCP
        for r in range(4):  # nothing moved by message inside a node
            assert all(nodes[dst] != nodes[r] for dst, _ in sent[r])


@pytest.mark.parametrize("nodes", [LAYOUTS["3x2"], [0, 0, 1, 0, 1, 2]], ids=["lanes", "leaders"])
async def test_concurrent_calls_awaited_out_of_order_keep_call_order(nodes) -> None:
    n = len(nodes)
    async with node_world(nodes) as (groups, _sent):
        xs = [data(r, 5000, "float64", 5) for r in range(n)]
        parts = [data(r, 700, "int32", 6) for r in range(n)]
        root = data(4, 3000, "float32", 8)

        async def run(g: Group) -> list:
            works = [
                g.all_reduce(xs[g.rank].copy()).start(),
                g.all_gather(parts[g.rank]).start(),
                g.broadcast(root.copy() if g.rank == 4 else np.zeros_like(root), root=4).start(),
                g.reduce_scatter(np.tile(xs[g.rank], n)).start(),
                g.scan(parts[g.rank].copy()).start(),  # on the group's links, in between
            ]
            return [await w.wait() for w in reversed(works)]

        outs = await on_all(groups, run)
        for r, (sc, rs, bc, ag, ar) in enumerate(outs):
            check(sc, oracle(parts[: r + 1], ReduceOp.SUM), f"scan rank {r}")
            check(ar, oracle(xs, ReduceOp.SUM), f"all_reduce rank {r}")
            check(ag, np.concatenate(parts), f"all_gather rank {r}")
            check(bc, root, f"broadcast rank {r}")
            check(rs, oracle(xs, ReduceOp.SUM), f"reduce_scatter rank {r}")
