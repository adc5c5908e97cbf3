"""Transports: the contract, the TCP peer mesh and the in-memory hub."""

from shardwire.worker.transport.base import Transport, TransportStats, TransportTimeout
from shardwire.worker.transport.memory import MemoryHub, MemoryTransport
from shardwire.worker.transport.mesh import ConnectFailed, MeshConfig, TcpMesh

__all__ = [
    "ConnectFailed",
    "MemoryHub",
    "MemoryTransport",
    "MeshConfig",
    "TcpMesh",
    "Transport",
    "TransportStats",
    "TransportTimeout",
]
