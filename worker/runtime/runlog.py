"""What a training run shows and leaves behind.

Rank 0 prints progress (a tqdm bar when stdout is a terminal and tqdm is installed,
plain periodic lines otherwise, so container logs stay readable) and writes the run
directory: ``metrics.jsonl`` (one JSON object per logged step) and ``summary.json``.
Every rank's bytes sent and received are gathered into each record, with the time per
step it spent waiting for collectives (``comm_s``: communication the step did not hide)
and the rest of the step (``compute_s``); ``summary.json`` gains each rank's share of
time spent waiting (``comm_share_per_rank``), which ``shardwire plot`` draws per rank.

Progress reaches the coordinator (``shardwire status``, the status page, ``/metrics``)
at every logged step and, between them, at most once a second from every rank's
:meth:`RunLog.step`: step, samples/s over the last report, loss and bytes move while the
job runs, whatever ``every`` is.

A directory that already holds ``metrics.jsonl`` is never truncated: it is refused with
:class:`RunDirInUse`, or, with ``next_free=True`` (for default directory names), the run
goes to the first free ``NAME-2``, ``NAME-3``, … beside it. A run resumed from a
checkpoint (``resume_from=STEP``) continues its own directory: records up to that step
are kept, later ones (from the attempt that did not reach the next checkpoint) are
dropped with a printed note, and the new records are appended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from shardwire.protocol import ShardwireError
from shardwire.worker.collectives.process import ProcessGroup, StepState
from shardwire.worker.observe.waits import WAITS

_MAX_SIBLINGS = 10_000
PROGRESS_EVERY_S = 1.0  # live progress between logged steps, at most this often


class RunDirInUse(ShardwireError, FileExistsError):
    """The run directory already holds another run's metrics."""


def _holds_metrics(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def _free_dir(run_dir: Path, next_free: bool) -> Path:
    if not _holds_metrics(run_dir):
        return run_dir
    if next_free:
        for n in range(2, _MAX_SIBLINGS):
            candidate = run_dir.with_name(f"{run_dir.name}-{n}")
            if not _holds_metrics(candidate):
                return candidate
    raise RunDirInUse(
        f"run directory {run_dir} already holds metrics.jsonl from another run; "
        "choose another --run-dir or remove that one"
    )


@dataclass
class RunLog:
    """Create on every rank (the records need every rank's traffic); rank 0 writes."""

    pg: ProcessGroup
    run_dir: Path
    total_steps: int
    every: int = 50
    out: TextIO = sys.stdout
    next_free: bool = False
    resume_from: int | None = None
    started: float = field(default_factory=time.perf_counter)
    _bar: Any = None
    _file: Any = None
    _last: tuple[float, int] = (0.0, 0)  # (time, step) of the last record
    _told: tuple[float, int] = (0.0, 0)  # (time, step) of the last progress report
    _waited: float = 0.0  # WAITS.seconds() at the last record
    _share: float | None = None  # this rank's share of time waiting, at the last record
    _held_out: float | None = None  # the latest held-out loss the script logged
    _split_sum: list[tuple[float, float]] = field(default_factory=list)  # rank 0: per rank

    def __post_init__(self) -> None:
        first = self.resume_from or 0
        self._last = self._told = (self.started, first)
        self._waited = WAITS.seconds()
        if self.pg.rank != 0:
            return
        if self.resume_from is not None and _holds_metrics(self.run_dir):
            self._file = self._continue(self.resume_from)
        else:
            self.run_dir = _free_dir(self.run_dir, self.next_free)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.run_dir / "metrics.jsonl").open("w", encoding="utf-8")
        if self.pg.interactive or self.out.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total_steps, file=self.out, unit="step")
            except ImportError:
                self._bar = None

    def _continue(self, step: int) -> Any:
        """Keep the records up to ``step``, then append (see the module docstring)."""
        path = self.run_dir / "metrics.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            partial = path.with_name(path.name + ".partial")
            partial.write_text("".join(kept), encoding="utf-8")
            os.replace(partial, path)
        print(
            f"resuming {self.run_dir} at step {step} "
            f"({len(lines) - len(kept)} later records of the interrupted attempt dropped)",
            file=self.out,
            flush=True,
        )
        return path.open("a", encoding="utf-8")

    async def step(
        self,
        step: int,
        *,
        samples: int,
        read: np.ndarray | None = None,
        held: Callable[[], tuple[str, Sequence[np.ndarray]]] | None = None,
        **metrics: float,
    ) -> None:
        """Record ``step`` (1-based) every ``every`` steps and at the last one.

        Every rank must call this with the same ``step``: the record gathers traffic.
        ``read`` (the indices of the samples this rank read in the step) and ``held``
        (what it holds, see :class:`StepState`) are for a chaos plan's invariant checks:
        nothing reads them without one.
        """
        loss = metrics.get("loss")
        self.pg.step_finished(step, StepState(read, held, None if loss is None else float(loss)))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()})
        if step % self.every and step != self.total_steps:
            self._tell(step, samples, metrics)
            return
        stats = self.pg.transport.stats
        now = time.perf_counter()
        last_time, last_step = self._last
        self._last = (now, step)
        # per step since the last record: the time spent waiting for collectives, and
        # the rest (measured before this record's own gather)
        steps = max(1, step - last_step)
        waited, self._waited = WAITS.seconds() - self._waited, WAITS.seconds()
        comm = waited / steps
        compute = max(0.0, (now - last_time) / steps - comm)
        # only rank 0 writes the record: the others send theirs, nobody gathers everything
        mine = [stats.bytes_sent, stats.bytes_received, comm, compute]
        traffic = await self.pg.gather_object(mine)
        rate = samples * (step - last_step) / max(now - last_time, 1e-9)
        self._share = comm / (comm + compute) if comm + compute else None
        self._report(step, rate, metrics)
        self._told = (now, step)
        if traffic is None:  # not rank 0
            return
        record = {
            "step": step,
            "time_s": round(now - self.started, 4),
            **metrics,
            "samples_per_s": rate,
            "bytes_sent": [t[0] for t in traffic],
            "bytes_received": [t[1] for t in traffic],
            "comm_s": [round(t[2], 6) for t in traffic],
            "compute_s": [round(t[3], 6) for t in traffic],
        }
        sums = self._split_sum or [(0.0, 0.0)] * len(traffic)
        self._split_sum = [
            (c + t[2] * steps, p + t[3] * steps) for (c, p), t in zip(sums, traffic, strict=True)
        ]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is None:
            shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            print(
                f"step {step}/{self.total_steps} {shown} samples/s {rate:.0f}",
                file=self.out,
                flush=True,
            )

    def _tell(self, step: int, samples: int, metrics: dict[str, float]) -> None:
        """Live progress between records, at most every PROGRESS_EVERY_S (no collective:
        each rank tells the coordinator its own)."""
        now = time.perf_counter()
        told_time, told_step = self._told
        if now - told_time < PROGRESS_EVERY_S:
            return
        self._told = (now, step)
        rate = samples * (step - told_step) / (now - told_time)
        self._report(step, rate, metrics)

    def _report(self, step: int, rate: float, metrics: dict[str, float]) -> None:
        loss = metrics.get("loss")
        if (held_out := metrics.get("held_out")) is not None:
            self._held_out = float(held_out)
        self.pg.report_progress(
            step,
            rate,
            None if loss is None else float(loss),
            total_steps=self.total_steps,
            held_out=self._held_out,
            comm_share=self._share,
        )

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` and print the final table (rank 0)."""
        if self.pg.rank != 0:
            return
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._split_sum:  # over the logged steps: the share of time spent waiting
            summary = {
                **summary,
                "comm_share_per_rank": [
                    round(c / (c + p), 3) if c + p else 0.0 for c, p in self._split_sum
                ],
            }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.pg.wrote_summary(self.run_dir / "summary.json")
        width = max(len(k) for k in summary)
        print("-" * (width + 24), file=self.out)
        for key, value in summary.items():
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            print(f"{key:<{width}}  {text}", file=self.out)
        print("-" * (width + 24), file=self.out, flush=True)
