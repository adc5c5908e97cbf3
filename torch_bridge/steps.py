"""A torch script's steps, told to shardwire: progress and what chaos plans check.

``shardwire.torch.step_finished(step, read=..., model=..., loss=...)`` after each
optimizer step does for a torch script what shardwire's run log does for its own
models: the step reaches the coordinator's status views (at most once a second), a
chaos plan's faults at a step fire there, and, every ``check_every`` steps of a plan,
the rank notes fingerprints of what it read and what it holds for the verdict's
invariants (``replicas agree``, ``data once``).

What a rank holds is its parameters as it holds them: whole tensors (DDP, a replica's
model) or its local shards (FSDP2's DTensors). Ranks that hold the same parts of the
model (every DDP rank; the same shard of every replica under HSDP) share a key, and a
plan checks that their bytes agree; ranks that each hold their own shard have nothing to
compare, and the verdict says so.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwire.torch.group import bridged
from shardwire.worker.collectives.process import ProcessGroup, StepState

_PROGRESS_EVERY_S = 1.0  # the status views' updates, at most this often
_REPORT_TIMEOUT = 60.0


def held(model: nn.Module) -> tuple[str, list[np.ndarray]]:
    """(key, arrays): the parameters this rank holds, and which parts of the model they
    are (every rank holding the same parts gets the same key)."""
    key = hashlib.sha256()
    arrays: list[np.ndarray] = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        where = _where(p)
        key.update(f"{name}:{where}".encode())
        arrays.append(local.detach().reshape(-1).view(torch.uint8).numpy())
    return key.hexdigest()[:16], arrays


def _where(p: torch.Tensor) -> str:
    """Which part of parameter ``p`` this rank holds: whole, or a DTensor's placement
    with its coordinate on each sharded mesh dimension (replicated ones do not count)."""
    if not isinstance(p, DTensor):
        return "whole"
    mesh, coords = p.device_mesh, p.device_mesh.get_coordinate() or []
    parts = [
        f"{placement}@{coords[dim]}"
        for dim, placement in enumerate(p.placements)
        if not placement.is_replicate()
    ]
    return ",".join(parts) or f"replicated over {mesh.shape}"


class Steps:
    """The steps of this process's torch script (one per process, made on first use)."""

    def __init__(self) -> None:
        self._told = 0.0  # when the status views last heard, monotonic
        self._last: tuple[int, float] | None = None  # (step, monotonic) at that report

    def finished(
        self,
        step: int,
        *,
        read: Sequence[int] | np.ndarray | None = None,
        model: nn.Module | None = None,
        loss: float | None = None,
        samples: int = 0,
        total_steps: int = 0,
    ) -> None:
        pg = dist.group.WORLD
        backend = bridged(pg) if pg is not None else None
        if backend is None:
            return  # the default group is another backend's (gloo): nothing to tell
        group = backend.shardwire_group
        if not isinstance(group, ProcessGroup):
            return  # ranks that met through torch's store: no coordinator, no plan
        state = StepState(
            read=None if read is None else np.asarray(read),
            held=None if model is None else (lambda: held(model)),
            loss=loss,
        )
        now = time.monotonic()
        report = now - self._told >= _PROGRESS_EVERY_S
        rate = 0.0
        if report and self._last is not None and now > self._last[1]:
            rate = samples * (step - self._last[0]) / (now - self._last[1])

        async def tell() -> None:
            if report:
                group.report_progress(step, rate, loss, total_steps=total_steps)
            group.step_finished(step, state)

        backend.run(tell(), _REPORT_TIMEOUT)  # the script waits: its tensors hold still
        if report:
            self._told, self._last = now, (step, now)
