"""Heartbeats: a worker's liveness and progress, sent by the worker itself or, where a
node agent runs, batched by the agent (one message a second per node, not per rank).

A worker under an agent sends each heartbeat to its agent over a local socket as a
:class:`RankBeat` (its rank and generation with the beat); the agent forwards the beats
received since its last message in :class:`NodeBeat` messages, packed by
:func:`pack_beats` under the control frame's size. The coordinator applies a node beat's
entries as the ranks' own heartbeats, for ranks of the agent's own node and the running
generation only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import Field

from shardwire.protocol.codec import pack_meta
from shardwire.protocol.fields import Msg, Rank, Str, Text
from shardwire.protocol.linkreports import LINKS_PER_BEAT, LinkReport


class Progress(Msg):
    """A worker's training progress, as it reports it and as status views show it.

    ``busy_s`` is how long the worker's event loop has not run (0 unless that exceeds the
    stall-warning threshold); ``busy_at`` and ``busy_stack`` say where its main thread is.
    A busy worker is reported, never failed: its heartbeats come from another thread.
    """

    step: int = 0
    total_steps: int = 0  # the run's total, where the script knows it (0: unknown)
    samples_per_s: float = 0.0
    loss: float | None = None
    held_out: float | None = None  # the latest held-out (evaluation) loss
    comm_share: float | None = None  # of its time lately, spent waiting for collectives
    bytes_sent: int = 0
    bytes_received: int = 0
    busy_s: float = 0.0
    busy_at: Str = ""
    busy_stack: Text = ""


class Heartbeat(Progress):
    """Liveness signal, with the worker's progress for status reporting, the
    collectives it ended since its last heartbeat: (group id, group size, sequence,
    microseconds from its start to its end), for straggler attribution, and its peer
    links that moved since then."""

    kind: Literal["heartbeat"] = "heartbeat"
    timings: Annotated[list[tuple[int, int, int, int]], Field(max_length=512)] = []
    links: Annotated[list[LinkReport], Field(max_length=LINKS_PER_BEAT)] = []


class RankBeat(Msg):
    """A worker's heartbeat to its node agent (never to the coordinator directly)."""

    kind: Literal["rank_beat"] = "rank_beat"
    rank: Rank
    generation: int
    beat: Heartbeat


NODE_BEATS = 1024  # entries a node beat holds at most (more: several messages)
# Bytes of encoded entries per node beat: a worst-case heartbeat (a stall's stack, 512
# timings, 64 links) is about 30 KB, so any one entry fits beside the frame's header
# inside the 64 KiB control-frame limit.
NODE_BEAT_BYTES = 48 * 1024


class NodeBeat(Msg):
    """From a node agent: the heartbeats its workers sent since its last node beat (none:
    the agent's own keepalive)."""

    kind: Literal["node_beat"] = "node_beat"
    beats: Annotated[list[RankBeat], Field(max_length=NODE_BEATS)] = []


def pack_beats(beats: Iterable[RankBeat], budget: int = NODE_BEAT_BYTES) -> list[NodeBeat]:
    """The fewest node beats, in order, whose entries each hold at most ``budget`` encoded
    bytes and :data:`NODE_BEATS` entries (an entry larger than the budget goes alone);
    at least one, possibly empty."""
    out: list[NodeBeat] = []
    batch: list[RankBeat] = []
    size = 0
    for beat in beats:
        n = len(pack_meta(beat.model_dump(mode="python")))  # as the frame will hold it
        if batch and (size + n > budget or len(batch) == NODE_BEATS):
            out.append(NodeBeat(beats=batch))
            batch, size = [], 0
        batch.append(beat)
        size += n
    if batch or not out:
        out.append(NodeBeat(beats=batch))
    return out
