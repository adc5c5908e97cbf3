"""DiLoCo for torch models on the shardwire backend.

:class:`TorchDiLoCo` runs shardwire's own :class:`~shardwire.worker.training.diloco.DiLoCo`
(the same outer loop, streaming fragments, overlap and int8/int4 syncs as for the numpy
layers) over a torch model's parameters: it views each CPU parameter as a numpy array
(no copy) and runs the outer synchronisation on shardwire's loop thread, over the
shardwire group behind a torch process group, while the calling thread waits.

    import shardwire.torch
    from shardwire.torch.diloco import TorchDiLoCo

    dist.init_process_group("shardwire")
    outer = dist.new_group(...)                      # one rank per replica
    diloco = TorchDiLoCo(model, outer, every=50, quantize="int8")
    diloco.begin()
    for x, y in batches:
        loss(model(x), y).backward(); opt.step(); opt.zero_grad()
        diloco.step()
    diloco.finish()
"""

from __future__ import annotations

from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardwire.protocol.errors import InvalidArgument
from shardwire.torch.group import bridged
from shardwire.worker.training.diloco import DiLoCo, Phase

T = TypeVar("T")


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's memory on this rank: a DTensor's local shard (it shares it)."""
    return p.to_local() if isinstance(p, DTensor) else p


def _place(p: torch.Tensor) -> tuple[int, int]:
    """(the first local element's place in the whole parameter, the parameter's size):
    a DTensor's local shard must be whole rows of dim 0 (FSDP2's ``Shard(0)``), or the
    whole parameter (``Replicate``)."""
    if not isinstance(p, DTensor):
        return 0, p.numel()
    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    rows = tuple(shape[1:]) == tuple(p.shape[1:]) and all(o == 0 for o in offset[1:])
    if not rows or tuple(shape) != tuple(local.shape):
        raise InvalidArgument(
            f"TorchDiLoCo takes parameters sharded on dim 0 (FSDP2's default), got "
            f"{p.placements} for a parameter of shape {tuple(p.shape)}"
        )
    row = int(np.prod(p.shape[1:], dtype=np.int64)) if p.dim() > 1 else 1
    return (int(offset[0]) * row if p.dim() else 0), p.numel()


class _Parameters:
    """A torch model's parameters as the arrays DiLoCo reads and replaces."""

    def __init__(self, model: nn.Module) -> None:
        # FSDP2's parameters are DTensors: each rank's local shard is what it holds and
        # what its outer group (the same shard of every replica) averages
        self.params = [_local(p.detach()) for p in model.parameters()]
        for p in self.params:
            if p.device.type != "cpu" or not p.is_contiguous():
                raise InvalidArgument(
                    f"DiLoCo needs contiguous CPU parameters, got one on {p.device} "
                    f"(contiguous: {p.is_contiguous()})"
                )
        self.views = [p.detach().numpy() for p in self.params]  # the parameters' memory
        self._places = [_place(p.detach()) for p in model.parameters()]

    def places(self) -> tuple[list[int], int]:
        """Where each local array begins in the whole model's flat vector, and its size:
        DiLoCo's fragments are cut in the whole model, so FSDP2 shards sync each element
        at the step the whole model's would."""
        starts, at = [], 0
        for start, numel in self._places:
            starts.append(at + start)
            at += numel
        return starts, at

    def shards(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(v, np.empty(0, v.dtype)) for v in self.views]  # (no gradients needed)

    async def update_shards(self, values: list[np.ndarray]) -> None:
        for view, value in zip(self.views, values, strict=True):
            view[...] = value


class TorchDiLoCo:
    """DiLoCo over ``group`` (a torch process group of the shardwire backend; None: the
    world) for ``model``'s parameters. ``options`` are DiLoCo's (``every``, ``outer_lr``,
    ``outer_momentum``, ``nesterov``, ``fragments``, ``overlap``, ``quantize``,
    ``block``). Every method blocks until shardwire's loop has done its part."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: float = 600.0,
        **options: Any,
    ) -> None:
        backend = bridged(group if group is not None else dist.group.WORLD)
        if backend is None:
            raise InvalidArgument(
                "TorchDiLoCo needs a process group of the shardwire backend "
                f"(dist.init_process_group('shardwire')), got {group!r}"
            )
        self._backend = backend
        self._timeout = timeout
        self.diloco = DiLoCo(_Parameters(model), backend.shardwire_group, **options)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._backend.run(coro, self._timeout)

    @property
    def phase(self) -> Phase:
        return self.diloco.phase

    def begin(self) -> None:
        """Start every replica from the outer group's rank 0 parameters."""
        self._run(self.diloco.begin())

    def step(self) -> None:
        """Call after each inner optimizer step."""
        self._run(self.diloco.step())

    def finish(self) -> None:
        """Leave every replica with the global parameters."""
        self._run(self.diloco.finish())

    def state_dict(self) -> dict[str, Any]:
        return self._run(self.diloco.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.diloco.load_state_dict(state)

    def save(self, path: str | Path) -> None:
        self._run(self.diloco.save(path))

    def load(self, path: str | Path) -> None:
        self.diloco.load(path)
