"""The collectives, as methods of :class:`Group` (torch-like names).

Each method validates its arguments, names the call by a *signature* (op, dtype, sizes,
reduction, root), and returns a :class:`Pending` call: ``await`` it for the result, or
``.start()`` it for a :class:`Work` handle. The algorithm is picked by
:func:`~shardwire.worker.collectives.plan.choose`; the tag scheme is written down there.
The reductions and the large-payload movements live here, the rest in ``movement``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.arena import programs
from shardwire.worker.collectives import bruck, ring, small
from shardwire.worker.collectives.args import dtype_name, flat, out_array, sizes_text
from shardwire.worker.collectives.call import Call
from shardwire.worker.collectives.core import group_id_for
from shardwire.worker.collectives.layout import bounds, offsets
from shardwire.worker.collectives.leaders import Leaders
from shardwire.worker.collectives.movement import Movement
from shardwire.worker.collectives.ops import ReduceOp, check_op, finish
from shardwire.worker.collectives.plan import GATHER_STEP, Algorithm
from shardwire.worker.collectives.tiers import Runner, Tiers
from shardwire.worker.collectives.work import Pending


class Group(Movement):
    """Collectives over a set of ranks. See :class:`GroupCore` for failure semantics."""

    def new_group(
        self, ranks: Sequence[int], *, name: str = "", timeout: float | None = None
    ) -> Group:
        """A subgroup; only its members call this. ``name`` tells apart groups with the
        same members. Each group has its own tag space, so groups run concurrently.

        Asking again for a group that is still open (same members and name) returns that
        group. This group owns the subgroup: :meth:`aclose` closes it too."""
        global_ranks = [self.ranks[r] for r in ranks]
        group_id = group_id_for(global_ranks, name)
        live = self.transport.groups.get(group_id)
        if live is not None:
            if not isinstance(live, Group) or list(live.ranks) != global_ranks:
                raise InvalidArgument(
                    f"group id {group_id} of ranks {global_ranks} (name {name!r}) collides "
                    f"with open group {list(live.ranks)}; use another name"
                )
            return live
        group = Group(
            self.transport,
            global_ranks,
            group_id=group_id,
            timeout=self.timeout if timeout is None else timeout,
            recorder=self.recorder,
        )
        self._adopt(group)
        return group

    @property
    def tiers(self) -> Tiers | Leaders | None:
        """The subgroups of a group laid out over several nodes: lanes when every node
        holds the same number of ranks (``collectives.tiers``), else node leaders
        (``collectives.leaders``); None for a group on one node."""
        layout = self.layout
        if self._tiers is None and layout is not None:
            even = len({len(ranks) for ranks in layout}) == 1
            self._tiers = Tiers(self, layout) if even else Leaders(self, layout)
        return self._tiers

    def _tiered(self, timeout: float | None) -> tuple[Tiers | Leaders | None, Runner | None, float]:
        """(tiers, their runner for a call made now, its time limit), tiers None when the
        group is flat."""
        tiers = self.tiers
        limit = self.timeout if timeout is None else timeout
        return tiers, (tiers.reserve() if tiers is not None else None), limit

    # ---- reductions --------------------------------------------------------------------

    def all_reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Reduce ``x`` over the group; in place unless ``out`` is given. Returns it."""
        op = op if type(op) is ReduceOp else ReduceOp(op)
        check_op(op, x.dtype)
        target = x if out is None else out_array(out, x.shape, x.dtype)
        buf = flat(target, "x" if out is None else "out")
        if out is not None:
            np.copyto(target, x)
        signature = f"all_reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}"
        tiers, run, limit = self._tiered(timeout)

        async def algorithm(c: Call) -> np.ndarray:
            if tiers is not None and run is not None:
                await run(c, lambda: tiers.all_reduce(c, buf, op, limit))
                return target
            how = c.choose("all_reduce", buf.nbytes)
            if how == Algorithm.DOUBLING:
                await small.all_reduce_doubling(c, buf, op)
                finish(op, buf, c.size)
            elif how == Algorithm.RING:
                await ring.all_reduce(c, buf, op)
            elif how == Algorithm.BRUCK:
                await bruck.all_reduce(c, buf, op)
            return target

        plan = (lambda ctx: programs.all_reduce(ctx, buf, op, self.size), target)
        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes, arena=plan)

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Reduce ``x`` (all chunks) over the group; rank r gets chunk r of axis 0.

        Chunks are equal (``len(x)`` divisible by the group size) or ``sizes``.
        """
        op = op if type(op) is ReduceOp else ReduceOp(op)
        check_op(op, x.dtype)
        sizes = self._split(len(x) if x.ndim else 0, sizes, "reduce_scatter input")
        row = math.prod(x.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(sizes)]
        src = flat(x, "x")
        result = out_array(out, (sizes[self.rank], *x.shape[1:]), x.dtype)
        signature = (
            f"reduce_scatter:{dtype_name(x.dtype)}:{list(x.shape)}:{sizes_text(sizes)}:{op.value}"
        )

        tiers, run, limit = self._tiered(timeout)

        async def algorithm(c: Call) -> np.ndarray:
            if tiers is not None and run is not None:
                await run(
                    c,
                    lambda: tiers.reduce_scatter(
                        c, src, segs, result.reshape(-1), op=op, limit=limit
                    ),
                )
                return result
            a, b = segs[c.rank]
            how = c.choose("reduce_scatter", x.nbytes)
            if how == Algorithm.DIRECT:
                parts = [src[s:e] for s, e in segs]
                peers = [p for p in range(c.size) if p != c.rank]
                got = await small.exchange(c, {p: parts[p] for p in peers}, dict.fromkeys(peers))
                acc = result.reshape(-1)
                np.copyto(acc, got[0] if c.rank else parts[0])
                for p in range(1, c.size):
                    c.combine(op, acc, got[p] if p != c.rank else parts[p], out=acc)
            elif how in (Algorithm.RING, Algorithm.BRUCK):
                acc = c.scratch(src.size, src.dtype)
                scatter = ring.reduce_scatter if how == Algorithm.RING else bruck.reduce_scatter
                await scatter(c, src, acc, segs, op)
                np.copyto(result.reshape(-1), acc[a:b])
            else:
                np.copyto(result.reshape(-1), src[a:b])
            finish(op, result, c.size)
            return result

        flat_result = result.reshape(-1)
        plan = (
            lambda ctx: programs.reduce_scatter(ctx, src, flat_result, segs, op, count=self.size),
            result,
        )
        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes, arena=plan)

    def reduce(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        root: int = 0,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray | None]:
        """Reduce ``x`` onto ``root``: root returns the result (in ``x`` unless ``out``);
        the others return None and keep ``x`` unchanged."""
        op = op if type(op) is ReduceOp else ReduceOp(op)
        check_op(op, x.dtype)
        self._check_root(root)
        src = flat(x, "x")
        target = x if out is None else out_array(out, x.shape, x.dtype)
        signature = f"reduce:{dtype_name(x.dtype)}:{x.size}:{op.value}:{root}"

        async def algorithm(c: Call) -> np.ndarray | None:
            how = c.choose("reduce", x.nbytes)
            if how == Algorithm.TREE:
                work = src.copy()
                await small.reduce_tree(c, work, op, root)
            elif how == Algorithm.RING:
                segs = bounds(src.size, c.size)
                acc = c.scratch(src.size, src.dtype)
                await ring.reduce_scatter(c, src, acc, segs, op)
                a, b = segs[c.rank]
                if c.rank == root:
                    incoming = {p: acc[s:e] for p, (s, e) in enumerate(segs)}
                    await small.exchange(c, {}, incoming, step=GATHER_STEP)
                else:
                    await c.send(root, acc[a:b], GATHER_STEP)
                work = acc
            else:
                work = src.copy()
            if c.rank != root:
                return None
            finish(op, work, c.size)
            np.copyto(target.reshape(-1), work)
            return target

        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes)

    # ---- data movement -----------------------------------------------------------------

    def all_gather(
        self,
        x: np.ndarray,
        *,
        sizes: Sequence[int] | None = None,
        out: np.ndarray | None = None,
        timeout: float | None = None,
    ) -> Pending[np.ndarray]:
        """Concatenate every rank's ``x`` along axis 0 (rank order).

        First dimensions are equal, or given for every rank in ``sizes``.
        """
        local = len(x) if x.ndim else 1
        x2 = x.reshape(1) if x.ndim == 0 else x
        sizes = [local] * self.size if sizes is None else list(sizes)
        if len(sizes) != self.size or sizes[self.rank] != local:
            raise InvalidArgument(
                f"sizes {sizes} must list {self.size} first dimensions, this rank's being {local}"
            )
        row = math.prod(x2.shape[1:])
        segs = [(a * row, b * row) for a, b in offsets(sizes)]
        result = out_array(out, (sum(sizes), *x2.shape[1:]), x.dtype)
        buf = flat(result, "out")
        a, b = segs[self.rank]
        src = flat(x2, "x")  # read while the call runs, like every collective's input
        signature = f"all_gather:{dtype_name(x.dtype)}:{list(x2.shape[1:])}:{sizes_text(sizes)}"

        tiers, run, limit = self._tiered(timeout)

        async def algorithm(c: Call) -> np.ndarray:
            np.copyto(buf[a:b], src)
            if tiers is not None and run is not None:
                await run(c, lambda: tiers.all_gather(c, buf, segs, limit))
                return result
            how = c.choose("all_gather", buf.nbytes)
            if how == Algorithm.DIRECT:
                mine = buf[a:b]
                incoming = {p: buf[s:e] for p, (s, e) in enumerate(segs)}
                await small.exchange(c, dict.fromkeys(range(c.size), mine), incoming)
            elif how == Algorithm.RING:
                await ring.all_gather(c, buf, segs)
            elif how == Algorithm.BRUCK:
                await bruck.all_gather(c, buf, segs)
            return result

        parts = [buf[s:e] for s, e in segs]
        plan = (lambda ctx: programs.all_gather(ctx, parts, src), result)
        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes, arena=plan)

    def broadcast(
        self, x: np.ndarray, *, root: int = 0, timeout: float | None = None
    ) -> Pending[np.ndarray]:
        """Overwrite ``x`` on every rank with root's ``x`` (same shape and dtype)."""
        self._check_root(root)
        buf = flat(x, "x")
        signature = f"broadcast:{dtype_name(x.dtype)}:{list(x.shape)}:{root}"

        tiers, run, limit = self._tiered(timeout)

        async def algorithm(c: Call) -> np.ndarray:
            if tiers is not None and run is not None:
                await run(c, lambda: tiers.broadcast(buf, root, limit))
                return x
            how = c.choose("broadcast", x.nbytes, crowded=self.transport.topology.crowded)
            if how == Algorithm.TREE:
                await small.broadcast_tree(c, buf, root)
            elif how == Algorithm.CHAIN:
                await ring.broadcast_chain(c, buf, root)
            return x

        plan = (lambda ctx: programs.broadcast(ctx, buf, root), x)
        return self._start(signature, algorithm, timeout=timeout, nbytes=x.nbytes, arena=plan)
