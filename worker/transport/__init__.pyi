"""The public names of `shardwire.worker.transport`, imported when first read (see
`__init__.py`)."""

from shardwire.worker.transport.base import Receive, Transport, TransportStats, TransportTimeout
from shardwire.worker.transport.book import AddressBook
from shardwire.worker.transport.dialing import ConnectFailed
from shardwire.worker.transport.listen import ListenFailed
from shardwire.worker.transport.memory import MemoryHub, MemoryTransport
from shardwire.worker.transport.mesh import TcpMesh
from shardwire.worker.transport.mesh_config import MeshConfig

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
