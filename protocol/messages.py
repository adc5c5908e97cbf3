"""Control messages: one pydantic discriminated union on the ``kind`` field.

Messages are validated once at the boundary (:func:`decode_message`) and are plain
immutable objects afterwards. New fields get defaults so older peers keep working; an
incompatible change bumps ``PROTOCOL_VERSION`` in :mod:`shardwire.protocol.frames`. The
``error`` message keeps its shape across versions so a version mismatch can be reported.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from shardwire.protocol.beats import Heartbeat, NodeBeat, Progress, RankBeat
from shardwire.protocol.clock import ClockQuery, ClockReply
from shardwire.protocol.errors import ProtocolError
from shardwire.protocol.fields import Cause, Hex, Rank, Reason, Size, Str, Text, Trace
from shardwire.protocol.fields import Msg as _Msg
from shardwire.protocol.placement import PeerPage, PeerQuery, Placement


class Hello(_Msg):
    """First message of every connection: who is calling, with a fresh client nonce."""

    kind: Literal["hello"] = "hello"
    role: Literal["worker", "agent", "peer", "client"]
    run_id: Str
    nonce: Hex
    rank: int = -1
    generation: int = 0


class Challenge(_Msg):
    """Server's fresh nonce and its proof of the token over both nonces."""

    kind: Literal["challenge"] = "challenge"
    nonce: Hex
    proof: Hex


class Proof(_Msg):
    """Client's proof of the token over both nonces."""

    kind: Literal["proof"] = "proof"
    proof: Hex


class Welcome(_Msg):
    """The handshake succeeded. ``epoch``: the coordinator's leadership among its
    replicas (etcd's revision of its election; 0 for a coordinator without replicas)."""

    kind: Literal["welcome"] = "welcome"
    epoch: Annotated[int, Field(ge=0)] = 0


class Error(_Msg):
    """A refusal with a stable ``code`` and a human-readable message; the sender closes."""

    kind: Literal["error"] = "error"
    code: Str
    message: Text


class Join(_Msg):
    """A worker process asks for a rank; a survivor re-forming in its process says so (the
    job sets its size; should the generation end before it forms, it joins the next)."""

    kind: Literal["join"] = "join"
    world_size: Size
    node_id: Str
    local_rank: Rank
    local_world_size: Size
    listen_host: Str = ""
    listen_port: Annotated[int, Field(ge=0, le=65535)] = 0
    fingerprint: Str = ""
    requested_rank: Rank | None = None
    reforming: bool = False  # a survivor re-forming in its process (live recovery)


class NodeJoin(_Msg):
    """A node agent (``shardwire worker``) asks for its node rank before spawning.

    An agent sends it again on the same connection once its processes of an ended
    generation are gone. ``world_size`` is the largest job (``MAX`` nodes); ``min_nodes``
    is 0 for a fixed node count, else the ``MIN`` of ``--nnodes MIN:MAX``.
    ``max_restarts`` is the agent's restart budget (None: the coordinator's).
    ``node_index`` is the node's place as its scheduler numbers it (``--node-rank``, its
    place in Slurm's node list, an Indexed Job's completion index): node ranks follow it;
    None: after those that give one, in the node ids' order.
    """

    kind: Literal["node_join"] = "node_join"
    world_size: Size
    node_id: Str
    local_world_size: Size
    min_nodes: Annotated[int, Field(ge=0, lt=1 << 20)] = 0
    max_restarts: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    node_index: Annotated[int, Field(ge=0, lt=1 << 24)] | None = None


class GenerationInfo(_Msg):
    """One generation of a job: its size, when it started and what ended it."""

    generation: Annotated[int, Field(ge=1)]
    world_size: int
    nodes: int = 0  # node agents in it (0: workers joined without agents)
    started_age_s: float  # seconds before the message was made
    duration_s: float | None = None  # None while it runs
    ended_by: Cause = ""  # the root cause, or "finished"


# The first generation and the latest ones: a long elastic job's history stays inside a
# control frame (HISTORY_SHOWN x about 1 KiB).
HISTORY_SHOWN = 32
_History = Annotated[list[GenerationInfo], Field(max_length=HISTORY_SHOWN)]


class NodeAssignment(_Msg):
    """The agent's node rank; its processes request ranks node_rank*L ... node_rank*L+L-1."""

    kind: Literal["node_assignment"] = "node_assignment"
    node_rank: Rank
    nnodes: Size
    world_size: Size
    generation: int = 1
    max_restarts: int = 0
    restarts: int = 0  # restarts used so far
    history: _History = []  # the generations before this one
    # how long to wait for a coordinator that went away (0: it keeps no journal, so it
    # will not come back and its loss ends the job)
    grace: Annotated[float, Field(ge=0, le=86400)] = 0.0


class Rejoin(_Msg):
    """A worker of a running generation, back after it lost its coordinator: its rank and
    the join it was placed by, which a restarted coordinator checks against its journal."""

    kind: Literal["rejoin"] = "rejoin"
    rank: Rank
    generation: int
    join: Join


class NodeRejoin(_Msg):
    """A node agent back after it lost its coordinator: its node rank and its join."""

    kind: Literal["node_rejoin"] = "node_rejoin"
    node_rank: Rank
    generation: int
    join: NodeJoin


class Rejoined(_Msg):
    """The coordinator took a rejoining worker or agent back into ``generation``."""

    kind: Literal["rejoined"] = "rejoined"
    generation: int


class Restart(_Msg):
    """To node agents: the generation ended; stop its processes, then send ``NodeJoin``
    again to take part in ``generation``. ``restarts`` counts the failures restarted so
    far (a membership change is not one)."""

    kind: Literal["restart"] = "restart"
    generation: int
    rank: int = -1
    reason: Reason
    restarts: int = 0
    max_restarts: int = 0


class Finished(_Msg):
    """To node agents: every rank of the job finished; no restart will follow."""

    kind: Literal["finished"] = "finished"
    generation: int


STATUS_PAGE = 200  # rank rows per status reply (about 40 KB: inside a control frame)


class StatusRequest(_Msg):
    """A monitoring client asks for the job state, with rank rows ``offset`` onwards (at
    most ``limit``; a job of any size is read page by page)."""

    kind: Literal["status_request"] = "status_request"
    offset: Annotated[int, Field(ge=0)] = 0
    limit: Annotated[int, Field(ge=1, le=STATUS_PAGE)] = STATUS_PAGE


class RankStatus(Progress):
    """One row of a status reply."""

    rank: int
    node_id: Str
    host: Str
    state: Str
    heartbeat_age_s: float = 0.0


class StatusReply(_Msg):
    """The job state as the coordinator sees it."""

    kind: Literal["status"] = "status"
    run_id: Str
    state: Str
    world_size: int = 0
    generation: int = 0
    failure: Reason = ""
    ranks: Annotated[list[RankStatus], Field(max_length=1 << 16)] = []
    total: int = 0  # rank rows in all (``ranks`` holds rows offset ... offset + len - 1)
    offset: int = 0
    restarts: int = 0
    max_restarts: int = 0
    generations: _History = []
    straggler: Reason = ""  # the rank that holds the others up, if one does
    slow_link: Reason = ""  # the peer link far slower than the others, if one is


class CollectiveRecord(_Msg):
    """One entry of a rank's flight recorder: a recent collective and how it went."""

    group: int  # group id (0: the world); alike on every member
    size: int = 0  # members of the group
    ranks: Annotated[list[Rank], Field(max_length=1024)] = []  # global ranks; [] if many
    runs: Annotated[list[tuple[int, int, int]], Field(max_length=32)] = []  # then these
    op: Str
    seq: int
    nbytes: int = 0
    age_s: float  # seconds since it started, when the record was taken
    duration_s: float | None = None  # None while it runs
    outcome: Str = "running"  # running | ok | timeout | error: ...
    pending: Annotated[list[Rank], Field(max_length=1024)] = []  # not heard from yet


class Diagnosis(_Msg):
    """What a rank was doing: its recent collectives and where its code is."""

    collectives: Annotated[list[CollectiveRecord], Field(max_length=64)] = []
    where: Str = ""  # "train.py:88 in load_batch"
    stack: Text = ""


class DiagnoseRequest(_Msg):
    """The coordinator asks a rank for its :class:`Diagnosis` (a job is hanging)."""

    kind: Literal["diagnose"] = "diagnose"


class DiagnoseReply(_Msg):
    """A rank's answer to :class:`DiagnoseRequest`, sent from its control thread."""

    kind: Literal["diagnosis"] = "diagnosis"
    diagnosis: Diagnosis


class Failure(_Msg):
    """A worker reports a failure; the coordinator aborts the job with this.

    ``rank`` is -1 when the sender itself raised, or the peer rank whose connection the
    sender saw die (so the abort names the dead rank even if its own coordinator
    connection is noticed later). ``code`` is ``"collective_timeout"`` when the sender
    gave up waiting for a collective: the coordinator then asks every rank for its
    diagnosis and names the rank that never arrived.
    """

    kind: Literal["failure"] = "failure"
    rank: int = -1
    reason: Reason
    traceback: Trace = ""
    code: Str = ""
    diagnosis: Diagnosis | None = None


class Abort(_Msg):
    """Broadcast to every survivor: rank ``rank`` failed for ``reason``.

    ``traceback`` is the failed rank's own (when it raised); ``stacks`` says where the
    culprits of a hang were (when an inquest named them).
    """

    kind: Literal["abort"] = "abort"
    rank: int
    reason: Reason
    traceback: Trace = ""
    stacks: Text = ""
    # the job goes on in a next generation (restarts were left): a survivor may re-form
    # in its process and join it (``Session.reform``)
    restarting: bool = False


class Poison(_Msg):
    """One rank's error for a whole collective group, relayed to the other members (the
    payload of a data frame with op ``__poison__``, so it is ordered with the data)."""

    kind: Literal["poison"] = "poison"
    group: Annotated[int, Field(ge=0)]
    error: Str  # the error's class name; unknown names become CollectiveError
    message: Text
    # The group's ranks as runs (start, stop, step), for the relay; empty when they take
    # more than 32 runs (then each rank relays by its own copy of the group).
    runs: Annotated[list[tuple[int, int, int]], Field(max_length=32)] = []
    down: bool = False  # travelling from the group's first rank down, else up to it
    origin: Annotated[int, Field(ge=-1)] = -1  # the rank the error began on


class Leave(_Msg):
    """A worker finished cleanly; its connection closing afterwards is not a failure."""

    kind: Literal["leave"] = "leave"


class Release(_Msg):
    """A peer proposes closing this idle connection (the next send dials again)."""

    kind: Literal["release"] = "release"


class ReleaseAnswer(_Msg):
    """The answer to ``Release``. ``ok``: the peer is idle too, sends nothing more on this
    connection, and the proposer closes it once its own frames are out."""

    kind: Literal["release_answer"] = "release_answer"
    ok: bool


class ShmOffer(_Msg):
    """A same-host peer offers a shared-memory segment for the payloads it sends."""

    kind: Literal["shm_offer"] = "shm_offer"
    name: Annotated[str, Field(max_length=128, pattern="^[0-9a-z-]+$")]
    slots: Annotated[int, Field(ge=1, le=1024)]
    slot_bytes: Annotated[int, Field(ge=4096, le=1 << 30)]
    nonce: Hex


class ShmAnswer(_Msg):
    """Whether the receiver attached the offered segment (else the pair stays on TCP)."""

    kind: Literal["shm_answer"] = "shm_answer"
    ok: bool
    reason: Text = ""


Message = Annotated[
    Hello
    | Challenge
    | Proof
    | Welcome
    | Error
    | Join
    | NodeJoin
    | NodeAssignment
    | Rejoin
    | NodeRejoin
    | Rejoined
    | Restart
    | Finished
    | Placement
    | PeerQuery
    | PeerPage
    | ClockQuery
    | ClockReply
    | Heartbeat
    | RankBeat
    | NodeBeat
    | StatusRequest
    | StatusReply
    | Failure
    | DiagnoseRequest
    | DiagnoseReply
    | Abort
    | Poison
    | Leave
    | Release
    | ReleaseAnswer
    | ShmOffer
    | ShmAnswer,
    Field(discriminator="kind"),
]

_ADAPTER: TypeAdapter[Message] = TypeAdapter(Message)


def decode_message(meta: dict[str, Any]) -> Message:
    """Validate a control frame's meta map into a message object."""
    try:
        return _ADAPTER.validate_python(meta)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(
            f"invalid control message {meta.get('kind')!r}: {where}: {first['msg']}"
        ) from None


def encode_message(msg: _Msg) -> dict[str, Any]:
    """Turn a message into a meta map."""
    return msg.model_dump(mode="python")
