"""The data-movement cases of ``conformance.py``: broadcast, the all-gathers, all-to-all,
gather, scatter, point to point, barrier and the object collectives, for every dtype,
with empty, uneven and non-contiguous tensors, and malformed calls both must refuse.

Extensions (shardwire serves, gloo refuses):

- float8, int16 and the unsigned integers wider than a byte in collectives (gloo moves
  them only point to point); the reference moves the same bytes typed as a dtype of the
  same width that gloo serves;
- the stacked output of ``all_gather_into_tensor`` that torch documents; the reference is
  the concatenated form, reshaped;
- uneven ``all_to_all``; the reference is ``all_to_all_single`` with the same splits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from conformance import Pair, Runner, done
from conformance_cases import values

Shape = tuple[int, ...]


# While a reference runs on gloo: the dtype that carries the bytes of the case's dtype.
_WIRE: list[torch.dtype] = []
_BITS = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}
_WIDE_INTS = (torch.int16, torch.uint16, torch.uint32, torch.uint64)


def _v(dtype: torch.dtype, shape: Shape, rank: int, salt: int = 0) -> torch.Tensor:
    t = values(dtype, shape, rank, salt, wide=True)
    return t.view(_WIRE[-1]) if _WIRE else t


def as_bits(case, dtype):
    """``case`` with its tensors' bytes typed as a dtype of the same width gloo moves."""

    def run(g, a):
        _WIRE.append(_BITS[dtype.itemsize])
        try:
            return [o.view(dtype) for o in case(g, a)]
        finally:
            _WIRE.pop()

    return run


def _blank(dtype: torch.dtype, shape: Shape) -> torch.Tensor:
    """An output buffer with a recognisable filler (what a rank did not write shows)."""
    return _v(dtype, shape, 99, 5)


def _sends(r: int, p: int) -> int:
    """Rows rank r sends rank p in the uneven all-to-alls (0, 1 or 2: some blocks empty)."""
    return (r + 2 * p) % 3


def broadcast(dtype, shape, root_last, transpose=False):
    def case(g, a):
        root = g.size() - 1 if root_last else 0
        t = _v(dtype, shape, g.rank())
        t = t.t() if transpose else t
        done(dist.broadcast(t, group_src=root, group=g, async_op=a))
        return [t]

    return case


def all_gather(dtype, shape, uneven=False):
    def case(g, a):
        n, r = g.size(), g.rank()
        rows = (lambda k: k + 1) if uneven else (lambda k: shape[0])
        outs = [_blank(dtype, (rows(k), *shape[1:])) for k in range(n)]
        done(dist.all_gather(outs, _v(dtype, (rows(r), *shape[1:]), r), group=g, async_op=a))
        return outs

    return case


def all_gather_single(dtype, shape, stack):
    def case(g, a):
        n = g.size()
        out = _blank(dtype, (n, *shape) if stack else (n * shape[0], *shape[1:]))
        done(dist.all_gather_into_tensor(out, _v(dtype, shape, g.rank()), group=g, async_op=a))
        return [out]

    return case


def all_gather_coalesced(dtype):
    def case(g, a):
        n, r = g.size(), g.rank()
        shapes = [(3,), (2, 2), (0,)]
        ins = [_v(dtype, s, r, i) for i, s in enumerate(shapes)]
        outs = [[_blank(dtype, s) for s in shapes] for _ in range(n)]
        done(dist.all_gather_coalesced(outs, ins, group=g, async_op=a))
        return [t for lst in outs for t in lst]

    return case


def coalesced_all_gather_single(dtype):
    def case(g, a):
        n, r = g.size(), g.rank()
        ins = [_v(dtype, (2,), r, 0), _v(dtype, (1, 3), r, 1)]
        outs = [_blank(dtype, (2 * n,)), _blank(dtype, (n, 3))]
        with dist._coalescing_manager(group=g, async_ops=a) as cm:
            for i, o in zip(ins, outs, strict=True):
                dist.all_gather_into_tensor(o, i, group=g)
        if a:
            cm.wait()
        return outs

    return case


def all_to_all_single(dtype, how):
    def case(g, a):
        n, r = g.size(), g.rank()
        if how == "even":
            x, out, ins, outs = _v(dtype, (2 * n, 2), r), _blank(dtype, (2 * n, 2)), None, None
        elif how == "empty":
            x, out, ins, outs = _v(dtype, (0, 2), r), _blank(dtype, (0, 2)), None, None
        else:
            ins = [_sends(r, p) for p in range(n)]
            outs = [_sends(p, r) for p in range(n)]
            x, out = _v(dtype, (sum(ins), 3), r), _blank(dtype, (sum(outs), 3))
        done(dist.all_to_all_single(out, x, outs, ins, group=g, async_op=a))
        return [out]

    return case


def stacked_by_cat(dtype, shape):
    def run(g, a):
        (out,) = all_gather_single(dtype, shape, stack=False)(g, a)
        return [out.reshape(g.size(), *shape)]

    return run


def all_to_all_by_single(dtype):
    def run(g, a):
        n, r = g.size(), g.rank()
        ins = [_v(dtype, (_sends(r, p), 2), r, p) for p in range(n)]
        rows = [_sends(p, r) for p in range(n)]
        out = _blank(dtype, (sum(rows), 2))
        sends = [_sends(r, p) for p in range(n)]
        done(dist.all_to_all_single(out, torch.cat(ins), rows, sends, group=g, async_op=a))
        return list(out.split(rows))

    return run


def all_to_all(dtype):
    def case(g, a):
        n, r = g.size(), g.rank()
        ins = [_v(dtype, (_sends(r, p), 2), r, p) for p in range(n)]
        outs = [_blank(dtype, (_sends(p, r), 2)) for p in range(n)]
        done(dist.all_to_all(outs, ins, group=g, async_op=a))
        return outs

    return case


def gather(dtype, shape):
    def case(g, a):
        n, r = g.size(), g.rank()
        root = n - 1
        outs = [_blank(dtype, shape) for _ in range(n)] if r == root else None
        done(dist.gather(_v(dtype, shape, r), outs, group_dst=root, group=g, async_op=a))
        return outs or []

    return case


def scatter(dtype, shape):
    def case(g, a):
        n, r = g.size(), g.rank()
        root = n - 1
        parts = [_v(dtype, shape, r, p) for p in range(n)] if r == root else None
        out = _blank(dtype, shape)
        done(dist.scatter(out, parts, group_src=root, group=g, async_op=a))
        return [out]

    return case


def ring(dtype, shape):
    """isend to the next rank, irecv from the previous one, with a tag."""

    def case(g, a):
        n, r = g.size(), g.rank()
        out = _blank(dtype, shape)
        works = [
            dist.isend(_v(dtype, shape, r), group_dst=(r + 1) % n, group=g, tag=5),
            dist.irecv(out, group_src=(r - 1) % n, group=g, tag=5),
        ]
        for w in works:
            w.wait()
        return [out]

    return case


def batched(dtype):
    def case(g, a):
        n, r = g.size(), g.rank()
        outs = [_blank(dtype, (3,)), _blank(dtype, (2, 2))]
        ops = [
            dist.P2POp(dist.irecv, outs[0], group=g, group_peer=(r - 1) % n),
            dist.P2POp(dist.isend, _v(dtype, (3,), r), group=g, group_peer=(r + 1) % n),
            dist.P2POp(dist.isend, _v(dtype, (2, 2), r, 1), group=g, group_peer=(r - 1) % n),
            dist.P2POp(dist.irecv, outs[1], group=g, group_peer=(r + 1) % n),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return outs

    return case


def exchange(dtype):
    """Blocking send and recv: group rank 0 sends to 1, which sends back (others idle)."""

    def case(g, a):
        r = g.rank()
        if r > 1:
            return []
        got = _blank(dtype, (2, 3))
        if r == 0:
            dist.send(_v(dtype, (2, 3), 0), group_dst=1, group=g)
            dist.recv(got, group_src=1, group=g, tag=2)
        else:
            dist.recv(got, group_src=0, group=g)
            dist.send(_v(dtype, (2, 3), 1), group_dst=0, group=g, tag=2)
        return [got]

    return case


def any_source(g, a):
    """Group rank 0 hears every other rank once: who sent (as group ranks) and what."""
    n, r = g.size(), g.rank()
    if r != 0:
        dist.send(_v(torch.int64, (n,), r), group_dst=0, group=g, tag=9)
        return []
    heard = {}
    for _ in range(n - 1):
        buf = _blank(torch.int64, (n,))
        src = dist.recv(buf, group=g, tag=9)
        heard[dist.get_group_rank(g, src)] = buf
    return [torch.tensor(sorted(heard))] + [heard[k] for k in sorted(heard)]


def objects(g, a):
    n, r = g.size(), g.rank()
    mine = {"rank": r, "payload": list(range(r * 3)), "text": "x" * (r + 1)}
    everyone = [None] * n
    dist.all_gather_object(everyone, mine, group=g)
    sent = [mine, "two"] if r == n - 1 else [None, None]
    dist.broadcast_object_list(sent, group_src=n - 1, group=g)
    at_root = [None] * n if r == 0 else None
    dist.gather_object(mine, at_root, group_dst=0, group=g)
    got = [None]
    dist.scatter_object_list(
        got, [f"for {p}" for p in range(n)] if r == 0 else None, group_src=0, group=g
    )
    text = repr((everyone, sent, at_root, got)).encode()
    return [torch.tensor(list(text), dtype=torch.uint8)]


def malformed(dtype, how):
    """A call every rank makes with the same mistake: both backends must refuse it."""

    def case(g, a):
        n, r = g.size(), g.rank()
        x = _v(dtype, (2, 3), r)
        if how == "all_gather reshaped outputs":
            done(dist.all_gather([_blank(dtype, (3, 2)) for _ in range(n)], x, group=g, async_op=a))
        elif how == "all_gather one output short":
            done(
                dist.all_gather(
                    [_blank(dtype, (2, 3)) for _ in range(n - 1)], x, group=g, async_op=a
                )
            )
        elif how == "all_gather_into_tensor output too long":
            out = _blank(dtype, (2 * n + 1, 3))
            done(dist.all_gather_into_tensor(out, x, group=g, async_op=a))
        elif how == "all_gather_coalesced reshaped outputs":
            outs = [[_blank(dtype, (3, 2))] for _ in range(n)]
            done(dist.all_gather_coalesced(outs, [x], group=g, async_op=a))
        elif how == "reduce_scatter_tensor input too long":
            out = _blank(dtype, (2, 3))
            done(dist.reduce_scatter_tensor(out, _v(dtype, (2 * n + 1, 3), r), group=g, async_op=a))
        elif how == "all_to_all_single splits short of the input":
            out = _blank(dtype, (2 * n, 3))
            sizes = [2] * n
            sizes[0] = 1
            done(
                dist.all_to_all_single(
                    out, _v(dtype, (2 * n, 3), r), sizes, sizes, group=g, async_op=a
                )
            )
        return [x]

    return case


MALFORMED = [
    "all_gather reshaped outputs",
    "all_gather one output short",
    "all_gather_into_tensor output too long",
    "all_gather_coalesced reshaped outputs",
    "reduce_scatter_tensor input too long",
    "all_to_all_single splits short of the input",
]


def barrier(g, a):
    done(dist.barrier(group=g, async_op=a))
    return [torch.ones(1)]


def _reference(label: str, d: torch.dtype, case, n: int):
    """How gloo computes a collective shardwire serves beyond it (see the module doc), or
    None where gloo serves it."""
    if label.startswith("all_gather_into_tensor stacked"):
        ref = stacked_by_cat(d, (2, 3))
    elif label.startswith("all_to_all uneven") and n > 1:  # one rank: a single block
        ref = all_to_all_by_single(d)
    else:
        ref = None
    if d in _WIDE_INTS or (d.is_floating_point and d.itemsize == 1):
        return as_bits(ref or case, d)
    return ref


def movements(run: Runner, pair: Pair, dtypes: list[torch.dtype], *, async_op: bool) -> None:
    n = pair.gloo.size()
    collectives, p2p = [], []
    for d in dtypes:
        collectives += [
            (f"broadcast root 0 {d}", broadcast(d, (2, 3), False)),
            (f"broadcast root last {d}", broadcast(d, (2, 3), True)),
            (f"broadcast empty {d}", broadcast(d, (0,), True)),
            (f"broadcast transposed {d}", broadcast(d, (3, 2), True, transpose=True)),
            (f"all_gather {d}", all_gather(d, (2, 3))),
            (f"all_gather uneven {d}", all_gather(d, (2, 3), uneven=True)),
            (f"all_gather empty {d}", all_gather(d, (0,))),
            (f"all_gather_into_tensor {d}", all_gather_single(d, (2, 3), stack=False)),
            (f"all_gather_into_tensor stacked {d}", all_gather_single(d, (2, 3), stack=True)),
            (f"all_gather_into_tensor empty {d}", all_gather_single(d, (0,), stack=False)),
            (f"all_gather_coalesced {d}", all_gather_coalesced(d)),
            (f"coalesced all_gather_into_tensor {d}", coalesced_all_gather_single(d)),
            (f"all_to_all_single {d}", all_to_all_single(d, "even")),
            (f"all_to_all_single uneven {d}", all_to_all_single(d, "uneven")),
            (f"all_to_all_single empty {d}", all_to_all_single(d, "empty")),
            (f"all_to_all uneven {d}", all_to_all(d)),
            (f"gather {d}", gather(d, (2, 3))),
            (f"gather empty {d}", gather(d, (0,))),
            (f"scatter {d}", scatter(d, (2, 3))),
            (f"scatter empty {d}", scatter(d, (0,))),
        ]
        if n > 1:
            p2p += [
                (f"isend/irecv {d}", ring(d, (2, 3))),
                (f"isend/irecv empty {d}", ring(d, (0,))),
                (f"batch_isend_irecv {d}", batched(d)),
                (f"send/recv {d}", exchange(d)),
            ]
    for d in (torch.float32, torch.int64):
        collectives += [(f"{how} {d}", malformed(d, how)) for how in MALFORMED]
    for label, case in collectives:
        ref = _reference(label, _dtype_of(label), case, n)
        run.check(label, case, pair, async_op=async_op, reference=ref)
    others = [("barrier", barrier), ("object collectives", objects)]
    if n > 1:
        others.append(("recv from any source", any_source))
    for label, case in p2p + others:
        run.check(label, case, pair, async_op=async_op)


def _dtype_of(label: str) -> torch.dtype:
    return getattr(torch, label.rsplit("torch.", 1)[1])
