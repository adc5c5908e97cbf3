"""torch's reducing collectives: allreduce, reduce and reduce_scatter in every form."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import torch
import torch.distributed as dist

from shardwire.torch.base import BridgeBase
from shardwire.torch.tensors import check_sizes, joined, reduction, scaled, stage_all
from shardwire.torch.work import BridgeWork


class Reductions(BridgeBase):
    """allreduce, reduce and reduce_scatter (list, single-tensor and coalesced forms)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.AllreduceOptions()
        how = reduction(opts.reduceOp, "allreduce", tensors)
        staged = stage_all(tensors, "allreduce", reduce=True)
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            # the tensor is overwritten by the result anyway: PREMUL_SUM scales it in place
            return [
                g.all_reduce(scaled(s.array, how, own=True), how.op, timeout=limit) for s in staged
            ]

        return self._submit("allreduce", calls, tensors, timeout=limit, after=staged)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        opts = opts or dist.ReduceOptions()
        how = reduction(opts.reduceOp, "reduce", tensors)
        root = opts.rootRank
        staged = stage_all(tensors, "reduce", reduce=True)
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce(scaled(s.array, how), how.op, root=root, out=s.array, timeout=limit)
                for s in staged
            ]

        writes = staged if g.rank == root else []
        return self._submit("reduce", calls, tensors, timeout=limit, after=writes)

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
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce_scatter(scaled(i.flat(), how), how.op, out=o.flat(), timeout=limit)
                for i, o in zip(ins, outs, strict=True)
            ]

        return self._submit("reduce_scatter", calls, outputs, timeout=limit, after=outs)

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
        limit = self._limit(opts)
        g = self._group

        def calls() -> list[Awaitable[Any]]:
            return [
                g.reduce_scatter(
                    scaled(x, how, own=True), how.op, sizes=sizes, out=o.flat(), timeout=limit
                )
                for (x, sizes), o in zip(sources, outs, strict=True)
            ]

        return self._submit("reduce_scatter", calls, outputs, timeout=limit, after=outs)
