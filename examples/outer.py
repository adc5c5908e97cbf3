"""DiLoCo for the examples (``--diloco H``): the ranks split into replicas that train on
their own (FSDP inside each) and synchronise every H steps over the outer group.

Without ``--diloco`` everything here is the plain run's: one replica of every rank.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np

import shardwire.worker as sw
from shardwire.worker.collectives import Group
from shardwire.worker.fsdp import FSDP, PeerCopies, Resumed, held_state
from shardwire.worker.fsdp.dilococopies import DiLoCoCopies
from shardwire.worker.training.diloco import DiLoCo, Sharded, replica_groups, replica_rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--diloco",
        type=int,
        default=0,
        metavar="H",
        help="DiLoCo: replicas train on their own and sync every H steps (0: off)",
    )
    p.add_argument("--replicas", type=int, help="DiLoCo replicas (default: one per node)")
    p.add_argument("--fragments", type=int, default=1, help="DiLoCo streaming fragments")
    p.add_argument("--overlap", action="store_true", help="overlap each sync with a step")
    p.add_argument(
        "--outer-quantize",
        default="none",
        choices=["none", "int8", "int4"],
        help="DiLoCo outer sync's wire format",
    )
    p.add_argument(
        "--outer-lr",
        type=float,
        default=0.7,
        help="DiLoCo's outer learning rate (the paper's 0.7; 1 with --outer-momentum 0: "
        "the replicas' parameters averaged)",
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=0.9,
        help="DiLoCo's outer Nesterov momentum (the paper's 0.9)",
    )


class Replicas:
    """This rank's replica: its inner group (FSDP's), the outer group, the batch rows."""

    def __init__(self, args: argparse.Namespace, pg: sw.ProcessGroup) -> None:
        self.args = args
        self.count = (args.replicas or pg.nnodes) if args.diloco else 1
        if args.diloco:
            self.inner, self.outer = replica_groups(pg, self.count)
        else:
            self.inner, self.outer = pg, None
        self.index = pg.rank // self.inner.size
        self.rank = pg.rank
        self.pg = pg
        self.diloco: DiLoCo | None = None

    def rows(self, batch: int, data: Group) -> tuple[np.ndarray, int]:
        """This rank's rows of a global batch, and its replica's row count (the count its
        loss is the mean over); ``data`` is the replica's data-parallel group."""
        return replica_rows(
            batch, replica=self.index, replicas=self.count, rank=data.rank, size=data.size
        )

    async def start(self, model: Sharded, copies: PeerCopies | None = None) -> None:
        """Build the outer synchronisation (``--diloco``) around ``model``, and bind it to
        the process's peer copies (``--copy-every``), which then cross replicas."""
        if self.outer is None:
            return
        a = self.args
        quantize = None if a.outer_quantize == "none" else a.outer_quantize
        self.diloco = DiLoCo(
            model,
            self.outer,
            every=a.diloco,
            fragments=a.fragments,
            overlap=a.overlap,
            quantize=quantize,
            outer_lr=a.outer_lr,
            outer_momentum=a.outer_momentum,
            nesterov=a.outer_momentum > 0,  # Nesterov's look-ahead needs a momentum
        )
        await self.diloco.begin()
        if isinstance(copies, DiLoCoCopies):
            copies.bind(self.diloco, self.pg, self.index)

    async def step(self) -> None:
        if self.diloco is not None:
            await self.diloco.step()

    async def finish(self) -> None:
        """Every replica ends with the global parameters."""
        if self.diloco is not None:
            await self.diloco.finish()

    def summary(self) -> dict:
        """What the run's summary says of the outer synchronisation (nothing without it)."""
        if self.diloco is None:
            return {}
        return {
            "diloco": {
                "every": self.args.diloco,
                "replicas": self.count,
                "fragments": self.args.fragments,
                "overlap": self.args.overlap,
                "quantize": self.args.outer_quantize,
                "outer_lr": self.args.outer_lr,
                "outer_momentum": self.args.outer_momentum,
            },
            "outer_sent_bytes": self.diloco.sent_bytes,
            "outer_largest_exchange_bytes": self.diloco.largest_sent,
        }

    def held(self, fsdp: FSDP) -> Callable[[], tuple[str, list[np.ndarray]]]:
        """What this rank holds, for a chaos plan's checks (``log.step(held=...)``); under
        DiLoCo the replicas train apart between outer steps, so each is compared apart."""

        def state() -> tuple[str, list[np.ndarray]]:
            key, arrays = held_state(fsdp)
            return (f"replica {self.index}: {key}" if self.diloco else key), arrays

        return state

    def checkpoints(self, directory: str) -> str:
        """Where this replica's checkpoints go (each replica has its own parameters)."""
        return str(Path(directory) / f"replica-{self.index}") if self.diloco else directory

    def _state(self, directory: str, step: int) -> Path:
        return Path(self.checkpoints(directory)) / "diloco" / f"step-{step:08d}-rank-{self.rank}.st"

    async def save(self, directory: str, step: int, keep: int | None) -> None:
        """The outer state beside the step's checkpoint; older ones beyond ``keep`` (as
        many as the checkpoints kept; None: all) go."""
        if self.diloco is None:
            return
        await self.diloco.save(self._state(directory, step))
        if keep is None:
            return
        mine = sorted(self._state(directory, step).parent.glob(f"step-*-rank-{self.rank}.st"))
        for old in mine[: max(0, len(mine) - keep)]:
            await asyncio.to_thread(old.unlink)

    def resume(self, directory: str, resumed: Resumed) -> None:
        """The outer state of a step loaded from disk (the peer copies' restore took a
        copy's outer state back already)."""
        if self.diloco is not None and resumed.path is not None:
            self.diloco.load(self._state(directory, resumed.step))
