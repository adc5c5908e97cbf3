"""Collectives as coroutines over a transport: see :class:`Group`."""

from shardwire.protocol import (
    CollectiveCancelled,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
)
from shardwire.worker.collectives.group import Group
from shardwire.worker.collectives.roster import DEFAULT_TIMEOUT, group_id_for
from shardwire.worker.collectives.work import Pending, Work
from shardwire.worker.kernels.reduce import ReduceOp

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveCancelled",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Group",
    "Pending",
    "ReduceOp",
    "Work",
    "group_id_for",
]
