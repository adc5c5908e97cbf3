"""The public names of `shardwire.worker`, imported when first read (see `__init__.py`)."""

from shardwire.protocol import (
    AuthFailed,
    CollectiveCancelled,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    DescriptorLimit,
    IntegrityError,
    JobAborted,
    LeftJob,
    PeerFailed,
    RecoveryError,
    RendezvousError,
    ShardwireError,
    Tag,
)
from shardwire.worker.api import Session, init
from shardwire.worker.collectives import Group, ReduceOp, Work
from shardwire.worker.collectives.process import ProcessGroup, StepState
from shardwire.worker.observe.trace import span
from shardwire.worker.parallelism import Mesh, MeshError
from shardwire.worker.runtime.launched import NotLaunched
from shardwire.worker.runtime.loop import run
from shardwire.worker.runtime.worker_config import WorkerConfig

__all__ = [
    "AuthFailed",
    "CollectiveCancelled",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "DescriptorLimit",
    "Group",
    "IntegrityError",
    "JobAborted",
    "LeftJob",
    "RecoveryError",
    "Mesh",
    "MeshError",
    "NotLaunched",
    "PeerFailed",
    "ProcessGroup",
    "ReduceOp",
    "StepState",
    "RendezvousError",
    "Session",
    "ShardwireError",
    "Tag",
    "Work",
    "WorkerConfig",
    "init",
    "run",
    "span",
]
