"""Live recovery for the examples (``--copy-every K``): each rank's training state is
copied to another rank's memory every K steps, and a job that recovers live
(``shardwire launch --recovery live``) restores from those copies, not from disk."""

from __future__ import annotations

import argparse

import shardwire.worker as sw
from shardwire.worker.fsdp import PeerCopies


def add_copy_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--copy-every",
        type=int,
        default=0,
        help="copy each rank's state to another rank's memory every this many steps; a job "
        "that recovers live (--recovery live) restores from the copies (0: off)",
    )


def peer_copies(args: argparse.Namespace, pg: sw.ProcessGroup) -> PeerCopies | None:
    """The process's copies (kept across re-formations), or None without --copy-every."""
    if not args.copy_every:
        return None
    return PeerCopies(args.copy_every, ranks_per_node=pg.local_world_size)
