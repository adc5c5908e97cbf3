"""Ray Train's torch trainer over the shardwire backend (``shardwire[ray,torch]``)::

    from ray.train.torch import TorchTrainer
    from shardwire.ray.train import ShardwireConfig

    TorchTrainer(train_fn, scaling_config=..., torch_config=ShardwireConfig()).fit()

Every worker imports :mod:`shardwire.torch` (which registers the backend) before Ray
Train forms its process group with ``backend="shardwire"``; the ranks meet through Ray
Train's own rendezvous (its store on worker 0), and every collective of ``train_fn``
(DDP's buckets, FSDP2's gathers and reductions) then runs on shardwire. A worker's
failure is met as Ray Train meets it (``FailureConfig``): the group starts again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.train.torch.config import TorchConfig, _TorchBackend

__all__ = ["ShardwireConfig"]


def _register() -> None:
    import shardwire.torch  # noqa: F401 - registers the "shardwire" backend


class _ShardwireBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_register)  # every worker, before the group forms
        super().on_start(worker_group, backend_config)


@dataclass
class ShardwireConfig(TorchConfig):
    """Ray Train's torch configuration with shardwire as the backend
    (``init_method`` and ``timeout_s`` as :class:`ray.train.torch.TorchConfig`'s)."""

    backend: str | None = "shardwire"

    @property
    def backend_cls(self) -> type[_ShardwireBackend]:
        return _ShardwireBackend
