"""The backend contract: how a group's calls move their bytes.

A group hands every call to one backend, chosen once from the roster
(``collectives.group``): the links backend (``backends.peerlinks``: the flat algorithms over
point-to-point messages), the arena backend (``backends.arena``: the node's shared
region, links where it cannot serve) or a tiered one (``backends.tiered`` and
``backends.leaders``: a node group's calls and a cross-node group's calls). The group
keeps sequence numbers, deadlines, poisoning and the flight recorder; a backend only
decides and moves:

* :meth:`Backend.decide` is the one place its algorithm is chosen; the
  :class:`Decision` goes to the flight recorder, the trace and the benchmarks;
* :meth:`Backend.express` may run a small call to its end at once, when it is made;
* :meth:`Backend.launch` places the call (the arena queues it when it is made, so its
  calls keep the group's order however they are awaited) and returns how to run it.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from shardwire.worker.backends.algorithms import Algorithm
from shardwire.worker.backends.call import Call
from shardwire.worker.backends.ops import Op
from shardwire.worker.kernels.reduce import ReduceOp
from shardwire.worker.observe.split import Split


@dataclass(frozen=True, slots=True)
class Decision:
    """How a call runs: its backend and the algorithm that backend chose."""

    backend: str  # links, arena or tiered
    algorithm: Algorithm

    def __str__(self) -> str:
        return f"{self.backend}/{self.algorithm}"


@dataclass(slots=True)
class PlacedCall:
    """A placed call: ``run`` moves its bytes (given the call) and returns its result;
    ``hurry`` (if any) is called when the call is started in the background."""

    run: Callable[[Call], Awaitable[Any]]
    hurry: Callable[[], None] | None = None


class Backend(abc.ABC):
    """Moves the bytes of one group's calls (see the module docstring)."""

    __slots__ = ()
    name: str

    @abc.abstractmethod
    def decide(self, op: Op) -> Decision:
        """The backend and algorithm a call of ``op`` uses (every rank decides alike)."""

    def express(self, op: Op, seq: int, signature: str, limit: float, split: Split | None) -> bool:
        """Run ``op`` to its end now if this backend can without waiting; True if it did."""
        return False

    @abc.abstractmethod
    def launch(self, op: Op, call: Call, decision: Decision, limit: float) -> PlacedCall:
        """Place the call just made (sequence ``call.seq``) in this backend's order."""

    def subgroups(self) -> Sequence[Subgroup]:
        """The groups its calls run their phases in (tiered backends)."""
        return ()

    def poison(self, error: BaseException) -> None:
        """The group failed with ``error``: wake whoever waits outside the messages."""

    def close(self) -> None:
        """The group is closing: release what the backend holds."""


class Subgroup(Protocol):
    """What a tiered backend needs of the groups it runs its phases in."""

    within: str
    expiring: BaseException | None
    rank: int
    size: int

    def all_reduce(
        self, x: np.ndarray, op: ReduceOp | str = ..., *, timeout: float | None = ...
    ) -> Awaitable[Any]: ...

    def reduce_scatter(
        self,
        x: np.ndarray,
        op: ReduceOp | str = ...,
        *,
        sizes: Sequence[int] | None = ...,
        out: np.ndarray | None = ...,
        timeout: float | None = ...,
    ) -> Awaitable[Any]: ...

    def all_gather(
        self,
        x: np.ndarray,
        *,
        sizes: Sequence[int] | None = ...,
        out: np.ndarray | None = ...,
        timeout: float | None = ...,
    ) -> Awaitable[Any]: ...

    def broadcast(
        self, x: np.ndarray, *, root: int = ..., timeout: float | None = ...
    ) -> Awaitable[Any]: ...

    def fail(self, error: BaseException) -> None: ...

    def silent_now(self) -> list[int]: ...

    def failed_now(self) -> BaseException | None: ...
