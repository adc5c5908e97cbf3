"""What a collective call asks for, as a frozen descriptor a backend runs.

A group validates a call's arguments and builds one of these (``collectives.requests``);
its backend decides how to run it (:meth:`Backend.decide`) and runs it. A descriptor
holds flat views of the caller's arrays, never copies: the call reads its inputs and
writes its outputs while it runs, like every collective. ``signature`` names the call
(op, dtype, sizes, reduction, root) in every message it sends, so ranks that made
different calls fail as a mismatch; ``nbytes`` is the payload the algorithm choice and
the flight recorder see; ``result`` is the output array the call fills and returns
(None where the backend makes the result itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from shardwire.worker.kernels.reduce import ReduceOp

Segments = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class AllReduce:
    """``buf`` (flat) becomes its reduction over the group, in place."""

    kind: ClassVar[str] = "all_reduce"
    signs_decision: ClassVar[bool] = False
    buf: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """``out`` (flat) gets segment ``segs[rank]`` of ``src`` reduced over the group."""

    kind: ClassVar[str] = "reduce_scatter"
    signs_decision: ClassVar[bool] = False
    src: np.ndarray
    segs: Segments
    out: np.ndarray
    op: ReduceOp
    result: np.ndarray
    signature: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class AllGather:
    """Every ``buf[segs[r]]`` gets rank r's ``src`` (rank order)."""

    kind: ClassVar[str] = "all_gather"
    signs_decision: ClassVar[bool] = False
    src: np.ndarray
    buf: np.ndarray
    segs: Segments
    result: np.ndarray
    signature: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Broadcast:
    """``buf`` (flat) becomes root's on every rank."""

    kind: ClassVar[str] = "broadcast"
    signs_decision: ClassVar[bool] = False
    buf: np.ndarray
    root: int
    result: np.ndarray
    signature: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """Root's ``target`` gets ``src`` reduced over the group; the others get None."""

    kind: ClassVar[str] = "reduce"
    signs_decision: ClassVar[bool] = False
    src: np.ndarray
    target: np.ndarray
    op: ReduceOp
    root: int
    signature: str
    nbytes: int
    result: None = None


@dataclass(frozen=True, slots=True)
class Gather:
    """Root's ``result`` gets every rank's ``src`` in rank order (``counts`` elements
    each); the others get None."""

    kind: ClassVar[str] = "gather"
    signs_decision: ClassVar[bool] = False
    src: np.ndarray
    counts: list[int]
    root: int
    result: np.ndarray | None
    signature: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Scatter:
    """Rank r gets ``chunks[r]`` of the root (the others pass no chunks), into ``out``
    when given."""

    kind: ClassVar[str] = "scatter"
    signs_decision: ClassVar[bool] = False
    chunks: list[np.ndarray] | None
    root: int
    out: np.ndarray | None
    signature: str
    nbytes: int
    result: None = None


@dataclass(frozen=True, slots=True)
class AllToAll:
    """Part p goes to rank p; the parts received are concatenated in rank order (into
    ``out``, of ``recv_segs`` rows, when the receivers gave their sizes). Whether this
    rank gave them is its own argument, so the algorithm decided goes into the signature:
    ranks that would run different ones fail as a mismatch, not a hang."""

    kind: ClassVar[str] = "all_to_all"
    signs_decision: ClassVar[bool] = True
    parts: list[np.ndarray]
    row_shape: tuple[int, ...]
    dtype: np.dtype
    out: np.ndarray | None
    recv_segs: Segments | None
    signature: str
    nbytes: int
    result: None = None


@dataclass(frozen=True, slots=True)
class Barrier:
    """Every member has entered."""

    kind: ClassVar[str] = "barrier"
    signs_decision: ClassVar[bool] = False
    signature: str = "barrier"
    nbytes: int = 0
    result: None = None


@dataclass(frozen=True, slots=True)
class Objects:
    """Small msgpack-able values: ``payload`` is this rank's, packed (None on a
    broadcast's non-roots). ``mode``: ``broadcast`` (root's on every rank), ``all`` (a
    list on every rank), ``gather`` (a list on the root)."""

    kind: ClassVar[str] = "objects"
    signs_decision: ClassVar[bool] = False
    payload: np.ndarray | None
    mode: str
    root: int
    signature: str
    nbytes: int = 0
    result: None = None


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
