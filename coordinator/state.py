"""The rendezvous's data: job and rank states, actions, members and configuration."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from shardwire.protocol.messages import Error, Heartbeat, Join, Message, NodeJoin

ConnId = Hashable


class JobState(enum.Enum):
    """Where the job is."""

    WAITING = "waiting"  # accepting joins
    RUNNING = "running"  # placements sent; watching liveness
    FAILING = "failing"  # a collective timed out; asking every rank what it is doing
    RESTARTING = "restarting"  # a generation ended; waiting until its processes are gone
    FAILED = "failed"  # a worker failed; abort broadcast
    FINISHED = "finished"  # every worker left cleanly


class RankState(enum.Enum):
    """Where one worker is."""

    JOINED = "joined"  # waiting for the world to complete
    RUNNING = "running"  # has its placement, heartbeating
    LEFT = "left"  # finished cleanly
    FAILED = "failed"  # died, hung or raised


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    msg: Message


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId


@dataclass(frozen=True, slots=True)
class Notice:
    """A line for the coordinator's log (the server logs it; nothing is sent)."""

    text: str


@dataclass(frozen=True, slots=True)
class Record:
    """A JSON document for the server to write to ``path`` (in the background)."""

    path: str
    doc: dict


Action = Send | Close | Notice | Record


@dataclass(slots=True)
class Worker:
    conn: ConnId
    join: Join
    host: str
    last_seen: float
    rank: int = -1
    state: RankState = RankState.JOINED
    progress: Heartbeat = field(default_factory=Heartbeat)  # the last one received
    connected: bool = True


@dataclass(slots=True)
class Agent:
    conn: ConnId
    join: NodeJoin
    node_rank: int | None = None  # in the running (or forming) generation
    ready: bool = True  # no processes of an ended generation left


@dataclass(frozen=True, slots=True)
class FailureRecord:
    rank: int
    reason: str
    traceback: str = ""
    stacks: str = ""  # where the culprits of a hang were (set by a hang inquest)


@dataclass(frozen=True, slots=True)
class RendezvousConfig:
    run_id: str
    world_size: int | None = None
    join_timeout: float = 300.0
    heartbeat_timeout: float = 5.0
    diagnose_timeout: float = 3.0  # how long a hang's inquest waits for the ranks' answers
    max_restarts: int | None = None  # None: the node agents say (0 without agents)
    min_nodes: int | None = None  # --nnodes MIN:MAX; None: the agents say (fixed count)
    last_call: float = 3.0  # seconds more joins are awaited once MIN nodes are in
    inquest_dir: str | None = None  # where a hang inquest's whole detail goes (None: nowhere)
    # how long workers and agents wait for this coordinator if it goes away, and how long
    # a restarted one waits for them to come back (0: no journal, no coming back)
    grace: float = 0.0


def refuse(conn: ConnId, code: str, message: str) -> list[Action]:
    return [Send(conn, Error(code=code, message=message)), Close(conn)]
