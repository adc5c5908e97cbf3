"""The process-group handle a worker script holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardwire.protocol.errors import InvalidArgument
from shardwire.protocol.messages import Heartbeat
from shardwire.worker.backends import ops
from shardwire.worker.collectives import DEFAULT_TIMEOUT, Group
from shardwire.worker.observe.flight import FlightRecorder
from shardwire.worker.transport.base import Transport


@dataclass(frozen=True)
class StepState:
    """What a rank holds after a step, for whoever watches the steps (a chaos plan's
    invariant checks); computed only when a watcher asks.

    Attributes:
        read: the indices of the samples this rank read in the step (or any array that
            says where it is in its data).
        held: ``() -> (key, arrays)``: what the rank holds (parameters, optimizer state);
            ranks with the same key must hold the same bytes (replicas).
        loss: the step's loss, as the script logged it.
    """

    read: np.ndarray | None = None
    held: Callable[[], tuple[str, Sequence[np.ndarray]]] | None = None
    loss: float | None = None


StepWatcher = Callable[[int, StepState | None], None]


class ProcessGroup(Group):
    """This process's place in the job, and collectives over every rank.

    Attributes:
        rank, world_size: global rank and number of worker processes.
        local_rank, local_world_size: index on this node and processes per node.
        node_rank: index of this node (it owns ranks node_rank*L ... node_rank*L+L-1).
        generation: rendezvous generation; every data frame carries it.
        transport: point-to-point messaging to the other ranks.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        local_rank: int,
        local_world_size: int,
        node_rank: int,
        generation: int,
        timeout: float = DEFAULT_TIMEOUT,
        progress: Callable[[Heartbeat], None] | None = None,
        interactive: bool = False,
        recorder: FlightRecorder | None = None,
    ):
        super().__init__(transport, timeout=timeout, recorder=recorder)
        self.world_size = self.size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.node_rank = node_rank
        self.generation = generation
        self._progress = progress or (lambda _heartbeat: None)
        self._watchers: list[StepWatcher] = []  # told each step reported
        self._summaries: list[Callable[[Path], None]] = []  # told where the summary went
        self.interactive = interactive  # a person watches this job's output on a terminal

    def report_progress(
        self,
        step: int,
        samples_per_s: float = 0.0,
        loss: float | None = None,
        *,
        total_steps: int = 0,
        held_out: float | None = None,
        comm_share: float | None = None,
    ) -> None:
        """Publish training progress (with this rank's traffic) to the coordinator's
        status views: ``shardwire status``, the status page and ``/metrics``.

        Args:
            step: the step this rank finished.
            samples_per_s: its recent throughput.
            loss: its latest training loss.
            total_steps: the run's total (0: unknown); the status page shows progress
                against it and estimates the time left.
            held_out: the latest held-out (evaluation) loss, drawn beside the training loss.
            comm_share: the share of its recent time spent waiting for collectives.
        """
        stats = self.transport.stats
        self._progress(
            Heartbeat(
                step=step,
                total_steps=total_steps,
                samples_per_s=samples_per_s,
                loss=loss,
                held_out=held_out,
                comm_share=comm_share,
                bytes_sent=stats.bytes_sent,
                bytes_received=stats.bytes_received,
            )
        )
        self.step_finished(step)

    def step_finished(self, step: int, state: StepState | None = None) -> None:
        """This rank finished ``step`` (the run log says so every step, with what the
        script handed it, and :meth:`report_progress` too): the watchers are told."""
        for watcher in self._watchers:
            watcher(step, state)

    def watch_steps(self, watcher: StepWatcher) -> None:
        """Call ``watcher(step, state)`` at each :meth:`step_finished` (what it raises,
        that raises)."""
        self._watchers.append(watcher)

    def wrote_summary(self, path: Path) -> None:
        """The run's summary was written to ``path`` (the run log says so on rank 0): a
        chaos plan's verdict is added to it when the job ends."""
        for watcher in self._summaries:
            watcher(path)

    def watch_summaries(self, watcher: Callable[[Path], None]) -> None:
        """Call ``watcher(path)`` at each :meth:`wrote_summary`."""
        self._summaries.append(watcher)

    def watch_calls(self, watcher: Callable[[int, str], None]) -> None:
        """Call ``watcher(seq, op)`` as each call of this group is placed (numbered from
        1). Only a group that is watched pays for it: the watch wraps this group's own
        call start, nothing is checked on the calls of any other."""
        start = self._start

        def started(op: Any, timeout: float | None) -> Any:
            pending = start(op, timeout)
            watcher(self._seq, ops.kind(op))
            return pending

        self._start = started  # type: ignore[method-assign]

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_ranks(self, node_rank: int | None = None) -> list[int]:
        """Global ranks on ``node_rank`` (default: this node)."""
        node = self.node_rank if node_rank is None else node_rank
        start = node * self.local_world_size
        return list(range(start, start + self.local_world_size))

    def node_group(self, *, local_world_size: int | None = None) -> Group:
        """This node's ranks as a group (``local_world_size`` overrides the node size,
        e.g. to test hybrid sharding on one host)."""
        size = local_world_size or self.local_world_size
        if self.world_size % size:
            raise InvalidArgument(f"world size {self.world_size} is not a multiple of {size}")
        start = self.rank - self.rank % size
        return self.new_group(range(start, start + size), name="node")

    def cross_node_group(self, *, local_world_size: int | None = None) -> Group:
        """The ranks with this rank's local index on every node, as a group."""
        size = local_world_size or self.local_world_size
        if self.world_size % size:
            raise InvalidArgument(f"world size {self.world_size} is not a multiple of {size}")
        return self.new_group(range(self.rank % size, self.world_size, size), name="cross")
