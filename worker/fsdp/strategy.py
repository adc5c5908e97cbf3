"""Sharding strategies and wrapping policies."""

from __future__ import annotations

import enum
from collections.abc import Callable

from shardwire.worker.nn.module import Module


class Strategy(enum.Enum):
    """What each rank keeps between steps (the ZeRO stages)."""

    FULL_SHARD = "full_shard"  # ZeRO-3: parameter, gradient and optimizer shards only
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: full parameters, sharded grads and state
    NO_SHARD = "no_shard"  # DDP: everything full, gradients all-reduced in buckets
    HYBRID_SHARD = "hybrid_shard"  # FULL_SHARD inside a node group, replicated across

    @property
    def shards_params(self) -> bool:
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)

    @property
    def shards_grads(self) -> bool:
        return self is not Strategy.NO_SHARD


Policy = Callable[[str, Module], bool]


def by_type(*types: type[Module]) -> Policy:
    """Wrap every module of these types (e.g. each transformer block) as a unit."""
    return lambda _name, module: isinstance(module, types)


def by_size(min_params: int) -> Policy:
    """Wrap every module whose own subtree holds at least ``min_params`` parameters and
    is not already inside a wrapped module."""

    def policy(_name: str, module: Module) -> bool:
        return sum(p.size for _, p in module.named_parameters()) >= min_params

    return policy
