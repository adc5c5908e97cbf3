"""Fully sharded data parallel training (ZeRO-3 / ZeRO-2 / DDP / hybrid)."""

from shardwire.worker.fsdp.config import FSDPConfig, MixedPrecision
from shardwire.worker.fsdp.copystate import held_state
from shardwire.worker.fsdp.offload import Offload
from shardwire.worker.fsdp.partition import fingerprint
from shardwire.worker.fsdp.peercopy import PeerCopies
from shardwire.worker.fsdp.persist import Resumed, SaveReport
from shardwire.worker.fsdp.store import CheckpointCorrupt, CheckpointError
from shardwire.worker.fsdp.store import latest as latest_checkpoint
from shardwire.worker.fsdp.strategy import Strategy, by_size, by_type
from shardwire.worker.fsdp.wrapper import FSDP, FSDPError

__all__ = [
    "FSDP",
    "CheckpointCorrupt",
    "CheckpointError",
    "FSDPConfig",
    "FSDPError",
    "MixedPrecision",
    "Offload",
    "PeerCopies",
    "Resumed",
    "SaveReport",
    "Strategy",
    "by_size",
    "by_type",
    "fingerprint",
    "held_state",
    "latest_checkpoint",
]
