"""What a collective call asks for, as a frozen descriptor a backend runs.

A group validates a call's arguments and builds one of these (``collectives.requests``):
a named tuple, immutable and made in a third of the time a frozen dataclass takes, on
every call. Its backend decides how to run it (:meth:`Backend.decide`) and runs it. A descriptor
holds flat views of the caller's arrays, never copies: the call reads its inputs and
writes its outputs while it runs, like every collective. ``signature`` names the call
(op, dtype, sizes, reduction, root) in every message it sends, so ranks that made
different calls fail as a mismatch; ``nbytes`` is the payload the algorithm choice and
the flight recorder see; ``result`` is the output array the call fills and returns
(None where the backend makes the result itself).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from shardwire.worker.kernels.reduce import ReduceOp

Segments = list[tuple[int, int]]


class AllReduce(NamedTuple):
    """``buf`` (flat) becomes its reduction over the group, in place."""

    buf: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int

    @property
    def kind(self) -> str:
        return "all_reduce"

    @property
    def signs_decision(self) -> bool:
        return False


class ReduceScatter(NamedTuple):
    """``out`` (flat) gets segment ``segs[rank]`` of ``src`` reduced over the group."""

    src: np.ndarray
    segs: Segments
    out: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int

    @property
    def kind(self) -> str:
        return "reduce_scatter"

    @property
    def signs_decision(self) -> bool:
        return False


class AllGather(NamedTuple):
    """Every ``buf[segs[r]]`` gets rank r's ``src`` (rank order)."""

    src: np.ndarray
    buf: np.ndarray
    segs: Segments
    result: np.ndarray
    signature: str
    nbytes: int

    @property
    def kind(self) -> str:
        return "all_gather"

    @property
    def signs_decision(self) -> bool:
        return False


class Broadcast(NamedTuple):
    """``buf`` (flat) becomes root's on every rank."""

    buf: np.ndarray
    root: int
    result: np.ndarray
    signature: str
    nbytes: int

    @property
    def kind(self) -> str:
        return "broadcast"

    @property
    def signs_decision(self) -> bool:
        return False


class Reduce(NamedTuple):
    """Root's ``target`` gets ``src`` reduced over the group; the others get None."""

    src: np.ndarray
    target: np.ndarray
    op: ReduceOp
    root: int
    signature: str
    nbytes: int
    result: None = None

    @property
    def kind(self) -> str:
        return "reduce"

    @property
    def signs_decision(self) -> bool:
        return False


class Gather(NamedTuple):
    """Root's ``result`` gets every rank's ``src`` in rank order (``counts`` elements
    each); the others get None."""

    src: np.ndarray
    counts: list[int]
    root: int
    result: np.ndarray | None
    signature: str
    nbytes: int

    @property
    def kind(self) -> str:
        return "gather"

    @property
    def signs_decision(self) -> bool:
        return False


class Scatter(NamedTuple):
    """Rank r gets ``chunks[r]`` of the root (the others pass no chunks), into ``out``
    when given."""

    chunks: list[np.ndarray] | None
    root: int
    out: np.ndarray | None
    signature: str
    nbytes: int
    result: None = None

    @property
    def kind(self) -> str:
        return "scatter"

    @property
    def signs_decision(self) -> bool:
        return False


class AllToAll(NamedTuple):
    """Part p goes to rank p; the parts received are concatenated in rank order (into
    ``out``, of ``recv_segs`` rows, when the receivers gave their sizes). Whether this
    rank gave them is its own argument, so the algorithm decided goes into the signature:
    ranks that would run different ones fail as a mismatch, not a hang."""

    parts: list[np.ndarray]
    row_shape: tuple[int, ...]
    dtype: np.dtype
    out: np.ndarray | None
    recv_segs: Segments | None
    signature: str
    nbytes: int
    result: None = None

    @property
    def kind(self) -> str:
        return "all_to_all"

    @property
    def signs_decision(self) -> bool:
        return True


class Barrier(NamedTuple):
    """Every member has entered."""

    signature: str = "barrier"
    nbytes: int = 0
    result: None = None

    @property
    def kind(self) -> str:
        return "barrier"

    @property
    def signs_decision(self) -> bool:
        return False


class Objects(NamedTuple):
    """Small msgpack-able values: ``payload`` is this rank's, packed (None on a
    broadcast's non-roots). ``mode``: ``broadcast`` (root's on every rank), ``all`` (a
    list on every rank), ``gather`` (a list on the root)."""

    payload: np.ndarray | None
    mode: str
    root: int
    signature: str
    nbytes: int = 0
    result: None = None

    @property
    def kind(self) -> str:
        return "objects"

    @property
    def signs_decision(self) -> bool:
        return False


Op = (
    AllReduce
    | ReduceScatter
    | AllGather
    | Broadcast
    | Reduce
    | Gather
    | Scatter
    | AllToAll
    | Barrier
    | Objects
)
