"""Live recovery for the examples (``--copy-every K``): each rank's training state is
copied to another rank's memory every K steps, and a job that recovers live
(``shardwire launch --recovery live``) restores from those copies, not from disk."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

import shardwire.worker as sw
from shardwire.worker.fsdp import FSDP, PeerCopies, Resumed, latest_checkpoint
from shardwire.worker.fsdp.dilococopies import DiLoCoCopies


def add_copy_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--copy-every",
        type=int,
        default=0,
        help="copy each rank's state to another rank's memory every this many steps; a job "
        "that recovers live (--recovery live) restores from the copies (0: off)",
    )


def peer_copies(
    args: argparse.Namespace, pg: sw.ProcessGroup, session: sw.Session
) -> PeerCopies | None:
    """The process's copies (kept across re-formations), or None without --copy-every.
    Under live recovery SIGTERM is a notice to leave: the rank hands its state over at
    its next copy step and leaves (``LeftJob``), and its replacement goes on from there.
    Under --diloco the copies cross replicas and carry the outer state too."""
    if not args.copy_every:
        return None
    # (a job of one rank has nobody to hand its state to: SIGTERM ends it as before)
    leave = session.leave_notice() if session.live and pg.world_size > 1 else None
    kind = DiLoCoCopies if args.diloco else PeerCopies
    return kind(args.copy_every, ranks_per_node=pg.local_world_size, leave=leave)


async def restore(
    fsdp: FSDP, copies: PeerCopies | None, ckpt: str | None, rngs: dict[str, np.random.Generator]
) -> Resumed | None:
    """The state to go on from: the peers' copies of a re-formed job, else the latest
    checkpoint in ``ckpt`` (if any), else None (the start)."""
    resumed = await copies.restore(fsdp, rngs=rngs) if copies else None
    if resumed is None and ckpt and await asyncio.to_thread(latest_checkpoint, Path(ckpt)):
        resumed = await fsdp.load(ckpt, rngs=rngs)
    return resumed


def records_from(step: int, pg: sw.ProcessGroup) -> int | None:
    """The run log's ``resume_from``: the step gone on from; a later generation that
    starts over from step 0 rewrites the records too (None: a fresh run's)."""
    return step or (0 if pg.generation > 1 else None)
