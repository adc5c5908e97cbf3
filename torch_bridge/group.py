"""``ShardwireProcessGroup``: every c10d method torch calls on a CPU process group.

Data movement (broadcast, the all-gathers, all-to-all, gather, scatter), barriers and
point-to-point here; the reductions in ``reductions``; identity and the hand-off to
shardwire's loop in ``base``. torch's two generations of method names
(``_allgather_base`` up to 2.12, ``all_gather_single`` from 2.13, and the coalesced
forms) lead to the same code.
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from shardwire.torch.reductions import Reductions
from shardwire.torch.tensors import (
    Staged,
    check_count,
    check_like,
    check_sizes,
    joined,
    split_into,
    stage_all,
)
from shardwire.torch.work import BridgeWork


class ShardwireProcessGroup(Reductions):
    """A torch process group whose collectives run on shardwire (see the package doc)."""

    # ---- broadcast and all-gathers -----------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.BroadcastOptions()
        staged = stage_all(tensors, "broadcast", reduce=False)
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [g.broadcast(s.array, root=opts.rootRank, timeout=limit) for s in staged]

        return self._submit("broadcast", calls, tensors, timeout=limit, after=staged)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BridgeWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single  # torch up to 2.12

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        opts = opts or AllgatherOptions()
        ins = stage_all(inputs, "all_gather input", reduce=False)
        outs = stage_all(outputs, "all_gather output", reduce=False, load=False)
        for i, o in zip(ins, outs, strict=True):
            check_sizes("all_gather output", o.array.size, i.array.size * self._group.size)
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.all_gather(i.flat(), out=o.flat(), timeout=limit)
                for i, o in zip(ins, outs, strict=True)
            ]

        return self._submit("all_gather", calls, outputs, timeout=limit, after=outs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # torch up to 2.12

    def allgather(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> BridgeWork:
        """``output_lists[i][k]``: rank k's ``inputs[i]``."""
        opts = opts or AllgatherOptions()
        g = self._group
        ins = stage_all(inputs, "allgather input", reduce=False)
        outs = [
            stage_all(lst, "allgather output", reduce=False, load=False) for lst in output_lists
        ]
        check_count("allgather outputs", len(outs), len(ins), "lists")
        for i, lst in zip(ins, outs, strict=True):
            check_count("allgather outputs", len(lst), g.size, "tensors, one per rank")
            for o in lst:
                check_like("allgather output", o, i)
        bufs = [np.empty(i.array.size * g.size, i.array.dtype) for i in ins]
        limit = self._limit(opts)

        def calls() -> list[Awaitable[Any]]:
            return [
                g.all_gather(i.flat(), out=buf, timeout=limit)
                for i, buf in zip(ins, bufs, strict=True)
            ]

        def finish() -> None:
            for buf, lst in zip(bufs, outs, strict=True):
                split_into(buf, lst)

        flat_outs = [t for lst in output_lists for t in lst]
        return self._submit("allgather", calls, flat_outs, timeout=limit, finish=finish)

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> BridgeWork:
        """``output_lists[k][i]``: rank k's ``inputs[i]`` (one list per rank, unlike
        :meth:`allgather`), all in one exchange of the inputs laid end to end."""
        opts = opts or AllgatherOptions()
        g = self._group
        ins = stage_all(inputs, "allgather_coalesced input", reduce=False)
        outs = [
            stage_all(lst, "allgather_coalesced output", reduce=False, load=False)
            for lst in output_lists
        ]
        check_count("allgather_coalesced outputs", len(outs), g.size, "lists, one per rank")
        for lst in outs:
            check_count("allgather_coalesced outputs", len(lst), len(ins), "tensors")
            for o, i in zip(lst, ins, strict=True):
                check_like("allgather_coalesced output", o, i)
        x = np.concatenate([i.flat() for i in ins]) if ins else np.empty(0, np.uint8)
        buf = np.empty(x.size * g.size, x.dtype)
        limit = self._limit(opts)
        flat_outs = [o for lst in outs for o in lst]
        return self._submit(
            "allgather_coalesced",
            lambda: [g.all_gather(x, out=buf, timeout=limit)],
            [t for lst in output_lists for t in lst],
            timeout=limit,
            finish=lambda: split_into(buf, flat_outs),
        )

    # ---- all-to-all, gather, scatter ---------------------------------------------------

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> BridgeWork:
        opts = opts or dist.AllToAllOptions()
        i = Staged(input, "all_to_all input", reduce=False)
        o = Staged(output, "all_to_all output", reduce=False, load=False)
        row_in = _row(input)
        row_out = _row(output)
        send = [s * row_in for s in input_splits] if input_splits else None
        # the output's size is known: its even split when none is given, so every block
        # goes straight to its rank (torch's exchanges are large)
        n = self._group.size
        recv = [s * row_out for s in output_splits] if output_splits else [output.numel() // n] * n
        limit = self._limit(opts)
        g = self._group
        got: list[np.ndarray] = []

        async def exchange() -> None:
            got.append(
                await g.all_to_all(i.flat(), send_splits=send, recv_splits=recv, timeout=limit)
            )

        def calls() -> list[Awaitable[Any]]:
            return [exchange()]

        def finish() -> None:
            check_sizes("all_to_all output", o.array.size, got[0].size)
            split_into(got[0], [o])

        return self._submit("all_to_all", calls, [output], timeout=limit, finish=finish)

    alltoall_base = all_to_all_single  # torch up to 2.12

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        opts = opts or dist.AllToAllOptions()
        x, send = joined(inputs, "alltoall input", reduce=False)
        outs = stage_all(outputs, "alltoall output", reduce=False, load=False)
        recv = [o.array.size for o in outs]
        limit = self._limit(opts)
        g = self._group
        got: list[np.ndarray] = []

        async def exchange() -> None:
            got.append(await g.all_to_all(x, send_splits=send, recv_splits=recv, timeout=limit))

        return self._submit(
            "alltoall",
            lambda: [exchange()],
            outputs,
            timeout=limit,
            finish=lambda: split_into(got[0], outs),
        )

    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        opts = opts or dist.GatherOptions()
        g = self._group
        root = opts.rootRank
        (i,) = stage_all(inputs, "gather input", reduce=False)
        outs = (
            stage_all(output_lists[0], "gather output", reduce=False, load=False)
            if g.rank == root
            else []
        )
        if g.rank == root:
            check_sizes("gather outputs", sum(o.array.size for o in outs), i.array.size * g.size)
        limit = self._limit(opts)
        got: list[np.ndarray | None] = []

        async def collect() -> None:
            got.append(await g.gather(i.flat(), root=root, timeout=limit))

        def finish() -> None:
            if got[0] is not None:
                split_into(got[0], outs)

        result = [t for lst in output_lists for t in lst]
        return self._submit("gather", lambda: [collect()], result, timeout=limit, finish=finish)

    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> BridgeWork:
        opts = opts or dist.ScatterOptions()
        g = self._group
        root = opts.rootRank
        (o,) = stage_all(outputs, "scatter output", reduce=False, load=False)
        x, sizes = (
            joined(input_lists[0], "scatter input", reduce=False)
            if g.rank == root
            else (None, None)
        )
        limit = self._limit(opts)

        def calls() -> list[Awaitable[Any]]:
            return [g.scatter(x, root=root, sizes=sizes, out=o.flat(), timeout=limit)]

        return self._submit("scatter", calls, outputs, timeout=limit, after=[o])

    # ---- barriers and point to point ---------------------------------------------------

    def barrier(self, opts: Any = None) -> BridgeWork:
        opts = opts or dist.BarrierOptions()
        limit = self._limit(opts)
        g = self._group
        return self._submit("barrier", lambda: [g.barrier(timeout=limit)], [], timeout=limit)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` (the
        ``CollectiveTimeout`` lists every silent rank, so ``wait_all_ranks`` is implied)."""
        opts = dist.BarrierOptions()
        if timeout is not None:
            opts.timeout = timeout
        self.barrier(opts).wait()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> BridgeWork:
        (s,) = stage_all(tensors, "send", reduce=False)
        g = self._group
        return self._submit(
            "send", lambda: [g.send(s.array, dst, tag=tag)], tensors, timeout=g.timeout
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> BridgeWork:
        (s,) = stage_all(tensors, "recv", reduce=False, load=False)
        g = self._group
        return self._submit(
            "recv",
            lambda: [g.recv(src, tag=tag, out=s.array)],
            tensors,
            timeout=g.timeout,
            after=[s],
            source=lambda _results: src,
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> BridgeWork:
        (s,) = stage_all(tensors, "recv", reduce=False, load=False)
        g = self._group
        return self._submit(
            "recv_anysource",
            lambda: [g.recv_any(tag=tag, out=s.array)],
            tensors,
            timeout=g.timeout,
            after=[s],
            source=lambda results: results[0][0],
        )


def _row(t: torch.Tensor) -> int:
    """Elements per row of axis 0 (splits count rows)."""
    return t.numel() // t.shape[0] if t.dim() and t.shape[0] else 1
