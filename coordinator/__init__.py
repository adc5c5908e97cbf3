"""Coordinator: rendezvous state machine, asyncio server and CLI."""

from shardwire.coordinator.rendezvous import Rendezvous
from shardwire.coordinator.server import CoordinatorServer, ServerConfig
from shardwire.coordinator.settings import CoordinatorSettings
from shardwire.coordinator.state import (
    Close,
    JobState,
    Notice,
    RankState,
    Record,
    RendezvousConfig,
    Send,
)

__all__ = [
    "Close",
    "CoordinatorServer",
    "CoordinatorSettings",
    "JobState",
    "Notice",
    "RankState",
    "Record",
    "Rendezvous",
    "RendezvousConfig",
    "Send",
    "ServerConfig",
]
