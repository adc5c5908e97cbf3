"""Worker side: user API, process group, transports and launcher.

Typical script::

    import shardwire.worker as sw

    async def main():
        async with sw.init() as pg:
            print(pg.rank, pg.world_size)

    sw.run(main())
"""

from shardwire.protocol import (
    AuthFailed,
    JobAborted,
    PeerFailed,
    RendezvousError,
    ShardwireError,
    Tag,
)
from shardwire.worker.api import Session, init
from shardwire.worker.group import ProcessGroup
from shardwire.worker.runtime import run
from shardwire.worker.settings import WorkerConfig

__all__ = [
    "AuthFailed",
    "JobAborted",
    "PeerFailed",
    "ProcessGroup",
    "RendezvousError",
    "Session",
    "ShardwireError",
    "Tag",
    "WorkerConfig",
    "init",
    "run",
]
