"""FSDP options as one small config object."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.fsdp.offload import Offload
from shardwire.worker.fsdp.strategy import Policy, Strategy
from shardwire.worker.training.compression import Codec


@dataclass(frozen=True)
class MixedPrecision:
    """Communicate (and compute with) lower precision; master shards keep their dtype.

    Attributes:
        param_dtype: dtype parameters are gathered in (e.g. float16 halves all-gather
            bytes); ``None`` keeps the master dtype.
        reduce_dtype: dtype gradients are reduced in; ``None`` keeps the master dtype.
    """

    param_dtype: DTypeLike | None = None
    reduce_dtype: DTypeLike | None = None

    def param(self, default: np.dtype) -> np.dtype:
        return default if self.param_dtype is None else np.dtype(self.param_dtype)

    def reduce(self, default: np.dtype) -> np.dtype:
        return default if self.reduce_dtype is None else np.dtype(self.reduce_dtype)


@dataclass(frozen=True)
class FSDPConfig:
    """How to shard.

    Attributes:
        strategy: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD.
        policy: which submodules become units (``by_type``/``by_size``); the rest of the
            parameters form the root unit.
        prefetch: gather the next units while the current one computes.
        prefetch_depth, prefetch_bytes: how many units ahead, and the most bytes of
            gathered-ahead parameters at once (None: no byte limit).
        shard_size: HYBRID_SHARD's intra-node group size (default: the process group's
            ``local_world_size``); a world size that is not a multiple is an error.
        mixed_precision: lower-precision gathers and reductions.
        bucket_bytes: NO_SHARD all-reduces gradients of consecutive units together until a
            bucket holds at least this many bytes.
        reduce_depth: the most gradient reductions in flight during backward; a unit's
            backward first waits for the oldest beyond it. This bounds the full-size
            gradients held at once (one per reduction in flight) at the cost of some
            overlap. None: no bound.
        compression: NO_SHARD only: a codec from :mod:`shardwire.worker.training.compression`
            (``TopK(ratio)``, ``Float16()``) that exchanges each unit's gradient instead
            of the all-reduce, at the end of backward (with ``no_sync``, of the synced one).
        offload: keep parameter shards, gradient shards and optimizer state in
            memory-mapped files, paged in per unit around its use
            (:class:`~shardwire.worker.fsdp.offload.Offload`).
    """

    strategy: Strategy = Strategy.FULL_SHARD
    policy: Policy | None = None
    prefetch: bool = True
    prefetch_depth: int = 1
    prefetch_bytes: int | None = None
    shard_size: int | None = None
    mixed_precision: MixedPrecision = MixedPrecision()
    bucket_bytes: int = 4 << 20
    reduce_depth: int | None = None
    compression: Codec | None = None
    offload: Offload | None = None

    def __post_init__(self) -> None:
        if self.reduce_depth is not None and self.reduce_depth < 1:
            raise InvalidArgument(f"reduce_depth must be at least 1, got {self.reduce_depth}")
        if self.compression is not None and self.strategy is not Strategy.NO_SHARD:
            raise InvalidArgument(
                f"gradient compression works with NO_SHARD, not {self.strategy.name}"
            )
