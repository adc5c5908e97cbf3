"""Transports: the contract, the TCP peer mesh and the in-memory hub."""

from shardwire.worker.transport.base import Transport, TransportStats
from shardwire.worker.transport.book import AddressBook
from shardwire.worker.transport.links import ConnectFailed
from shardwire.worker.transport.listen import ListenFailed
from shardwire.worker.transport.memory import MemoryHub, MemoryTransport
from shardwire.worker.transport.mesh import MeshConfig, TcpMesh
from shardwire.worker.transport.receive import Receive, TransportTimeout

__all__ = [
    "AddressBook",
    "ConnectFailed",
    "ListenFailed",
    "MemoryHub",
    "MemoryTransport",
    "MeshConfig",
    "Receive",
    "TcpMesh",
    "Transport",
    "TransportStats",
    "TransportTimeout",
]
