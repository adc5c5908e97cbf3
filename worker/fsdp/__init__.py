"""Fully sharded data parallel training (ZeRO-3 / ZeRO-2 / DDP / hybrid)."""

from shardwire.worker.fsdp.config import FSDPConfig, MixedPrecision
from shardwire.worker.fsdp.strategy import Strategy, by_size, by_type
from shardwire.worker.fsdp.wrapper import FSDP, FSDPError, fingerprint

__all__ = [
    "FSDP",
    "FSDPConfig",
    "FSDPError",
    "MixedPrecision",
    "Strategy",
    "by_size",
    "by_type",
    "fingerprint",
]
