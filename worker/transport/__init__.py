"""Transports: the contract, the TCP peer mesh and the in-memory hub."""

from shardwire.worker.transport.base import Receive, Transport, TransportStats, TransportTimeout
from shardwire.worker.transport.memory import MemoryHub, MemoryTransport
from shardwire.worker.transport.mesh import ConnectFailed, MeshConfig, TcpMesh

__all__ = [
    "ConnectFailed",
    "MemoryHub",
    "MemoryTransport",
    "MeshConfig",
    "Receive",
    "TcpMesh",
    "Transport",
    "TransportStats",
    "TransportTimeout",
]
