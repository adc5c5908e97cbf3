"""Coordinator: rendezvous state machine, asyncio server and CLI."""

from shardwire.coordinator.rendezvous import (
    Close,
    JobState,
    RankState,
    Rendezvous,
    RendezvousConfig,
    Send,
)
from shardwire.coordinator.server import CoordinatorServer, ServerConfig
from shardwire.coordinator.settings import CoordinatorSettings

__all__ = [
    "Close",
    "CoordinatorServer",
    "CoordinatorSettings",
    "JobState",
    "RankState",
    "Rendezvous",
    "RendezvousConfig",
    "Send",
    "ServerConfig",
]
