"""``ShardwireProcessGroup``: every c10d method torch calls on a CPU process group.

The group *has* its hand-off to shardwire's loop (``handoff``: staging is the method's,
the calls and their ``Work`` the hand-off's) and its identity (the name and description
torch gives it). torch's two generations of method names (``_allgather_base`` up to
2.12, ``all_gather_single`` from 2.13, and the coalesced forms) lead to the same code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from shardwire.torch.handoff import Handoff
from shardwire.torch.loopthread import LoopThread
from shardwire.torch.tensors import (
    Staged,
    check_count,
    check_like,
    check_sizes,
    joined,
    reduction,
    scaled,
    split_into,
    stage_all,
)
from shardwire.torch.work import BridgeWork
from shardwire.worker.collectives import Group

T = TypeVar("T")


def bridged(pg: Any) -> ShardwireProcessGroup | None:
    """The shardwire group behind torch process group ``pg`` (None: another backend)."""
    if isinstance(pg, ShardwireProcessGroup):  # the backend's own group (its extended API)
        return pg
    try:
        backend = pg._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return backend if isinstance(backend, ShardwireProcessGroup) else None


class ShardwireProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run on one shardwire group (the world or
    a subgroup; see the package doc)."""

    def __init__(
        self, engine: LoopThread, group: Group, *, timeout: float, on_shutdown: Callable[[], None]
    ):
        super().__init__(group.rank, group.size)
        self._handoff = Handoff(engine, group, timeout)
        self._group = group
        self._on_shutdown = on_shutdown
        self._desc = ""

    # ---- identity ----------------------------------------------------------------------
    # torch keeps neither name nor description for a group written in Python; DeviceMesh
    # and FSDP2 read them back ("ProcessGroup name not set" otherwise).

    def getBackendName(self) -> str:
        return "shardwire"

    def setGroupName(self, name: str) -> None:
        self._handoff.name = name

    def getGroupName(self) -> str:
        return self._handoff.name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc
    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices whose tensors the group's collectives take: the CPU's. torch's
        Python side asks (``dcp.async_save`` refuses a group without a CPU backend); a
        group written in Python registers no backend with torch's C++ side to tell it."""
        return [torch.device("cpu")]

    @property
    def shardwire_group(self) -> Group:
        """The shardwire group this torch group runs on."""
        return self._group

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on shardwire's loop and wait for it, at most ``timeout`` seconds
        (from a torch thread: a training loop, or DCP's asynchronous save)."""
        return self._handoff.run(coro, timeout)

    def __repr__(self) -> str:
        g = self._group
        return f"ShardwireProcessGroup(rank={g.rank}, size={g.size}, name={self._handoff.name!r})"

    def shutdown(self) -> None:
        """``destroy_process_group``: close the shardwire group (the default group's
        shutdown leaves the job and stops shardwire's loop)."""
        self._on_shutdown()

    def abort(self) -> None:
        self._on_shutdown()

    # ---- reductions --------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.AllreduceOptions()
        how = reduction(opts.reduceOp, "allreduce", tensors)
        staged = stage_all(tensors, "allreduce", reduce=True)
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            # the tensor is overwritten by the result anyway: PREMUL_SUM scales it in place
            return [
                g.all_reduce(scaled(s.array, how, own=True), how.op, timeout=limit) for s in staged
            ]

        return self._handoff.submit("allreduce", calls, tensors, timeout=limit, after=staged)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.ReduceOptions()
        how = reduction(opts.reduceOp, "reduce", tensors)
        root = opts.rootRank
        staged = stage_all(tensors, "reduce", reduce=True)
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce(scaled(s.array, how), how.op, root=root, out=s.array, timeout=limit)
                for s in staged
            ]

        writes = staged if g.rank == root else []
        return self._handoff.submit("reduce", calls, tensors, timeout=limit, after=writes)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> BridgeWork:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single  # torch up to 2.12

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        opts = opts or dist.ReduceScatterOptions()
        how = reduction(opts.reduceOp, "reduce_scatter", inputs)
        ins = stage_all(inputs, "reduce_scatter input", reduce=True)
        outs = stage_all(outputs, "reduce_scatter output", reduce=True, load=False)
        for i, o in zip(ins, outs, strict=True):
            check_sizes("reduce_scatter input", i.array.size, o.array.size * self._group.size)
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce_scatter(scaled(i.flat(), how), how.op, out=o.flat(), timeout=limit)
                for i, o in zip(ins, outs, strict=True)
            ]

        return self._handoff.submit("reduce_scatter", calls, outputs, timeout=limit, after=outs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # torch up to 2.12

    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> BridgeWork:
        opts = opts or dist.ReduceScatterOptions()
        how = reduction(opts.reduceOp, "reduce_scatter", outputs)
        outs = stage_all(outputs, "reduce_scatter output", reduce=True, load=False)
        sources = [joined(parts, "reduce_scatter input", reduce=True) for parts in input_lists]
        for (_, sizes), o in zip(sources, outs, strict=True):
            check_sizes("reduce_scatter output", o.array.size, sizes[self._group.rank])
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce_scatter(
                    scaled(x, how, own=True), how.op, sizes=sizes, out=o.flat(), timeout=limit
                )
                for (x, sizes), o in zip(sources, outs, strict=True)
            ]

        return self._handoff.submit("reduce_scatter", calls, outputs, timeout=limit, after=outs)

    # ---- broadcast and all-gathers -----------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.BroadcastOptions()
        staged = stage_all(tensors, "broadcast", reduce=False)
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [g.broadcast(s.array, root=opts.rootRank, timeout=limit) for s in staged]

        return self._handoff.submit("broadcast", calls, tensors, timeout=limit, after=staged)

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
        limit = self._handoff.limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.all_gather(i.flat(), out=o.flat(), timeout=limit)
                for i, o in zip(ins, outs, strict=True)
            ]

        return self._handoff.submit("all_gather", calls, outputs, timeout=limit, after=outs)

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
        limit = self._handoff.limit(opts)

        def calls() -> list[Awaitable[Any]]:
            return [
                g.all_gather(i.flat(), out=buf, timeout=limit)
                for i, buf in zip(ins, bufs, strict=True)
            ]

        def finish() -> None:
            for buf, lst in zip(bufs, outs, strict=True):
                split_into(buf, lst)

        flat_outs = [t for lst in output_lists for t in lst]
        return self._handoff.submit("allgather", calls, flat_outs, timeout=limit, finish=finish)

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
        limit = self._handoff.limit(opts)
        flat_outs = [o for lst in outs for o in lst]
        return self._handoff.submit(
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
        limit = self._handoff.limit(opts)
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

        return self._handoff.submit("all_to_all", calls, [output], timeout=limit, finish=finish)

    alltoall_base = all_to_all_single  # torch up to 2.12

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        opts = opts or dist.AllToAllOptions()
        x, send = joined(inputs, "alltoall input", reduce=False)
        outs = stage_all(outputs, "alltoall output", reduce=False, load=False)
        recv = [o.array.size for o in outs]
        limit = self._handoff.limit(opts)
        g = self._group
        got: list[np.ndarray] = []

        async def exchange() -> None:
            got.append(await g.all_to_all(x, send_splits=send, recv_splits=recv, timeout=limit))

        return self._handoff.submit(
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
        limit = self._handoff.limit(opts)
        got: list[np.ndarray | None] = []

        async def collect() -> None:
            got.append(await g.gather(i.flat(), root=root, timeout=limit))

        def finish() -> None:
            if got[0] is not None:
                split_into(got[0], outs)

        result = [t for lst in output_lists for t in lst]
        return self._handoff.submit(
            "gather", lambda: [collect()], result, timeout=limit, finish=finish
        )

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
        limit = self._handoff.limit(opts)

        def calls() -> list[Awaitable[Any]]:
            return [g.scatter(x, root=root, sizes=sizes, out=o.flat(), timeout=limit)]

        return self._handoff.submit("scatter", calls, outputs, timeout=limit, after=[o])

    # ---- barriers and point to point ---------------------------------------------------

    def barrier(self, opts: Any = None) -> BridgeWork:
        opts = opts or dist.BarrierOptions()
        limit = self._handoff.limit(opts)
        g = self._group
        return self._handoff.submit(
            "barrier", lambda: [g.barrier(timeout=limit)], [], timeout=limit
        )

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
        return self._handoff.submit(
            "send", lambda: [g.send(s.array, dst, tag=tag)], tensors, timeout=g.timeout
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> BridgeWork:
        (s,) = stage_all(tensors, "recv", reduce=False, load=False)
        g = self._group
        return self._handoff.submit(
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
        return self._handoff.submit(
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
