"""Where a worker stands in its generation, and the addresses of the peers it asks for
(messages whose size does not grow with the job)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from shardwire.protocol.fields import Msg, Rank, Size, Str


class Member(Msg):
    """One worker of a formed generation, as a ``PeerPage`` lists it."""

    rank: Rank
    node_id: Str
    node_rank: Rank
    local_rank: Rank
    host: Str
    port: Annotated[int, Field(ge=0, le=65535)]


class Placement(Msg):
    """To every worker once its generation formed: its place, in a few numbers whatever
    the job's size. Ranks are contiguous per node (node ``r // local_world_size``); a
    peer's address is asked for when this rank first needs it (``PeerQuery``)."""

    kind: Literal["placement"] = "placement"
    rank: Rank
    world_size: Size
    generation: int
    local_rank: Rank
    local_world_size: Size
    node_rank: Rank
    # how long to wait for a coordinator that went away (0: it keeps no journal, so it
    # will not come back and its loss ends the job)
    grace: Annotated[float, Field(ge=0, le=86400)] = 0.0
    # every worker of the generation is on this machine (each reached at a loopback
    # address): its links are memory copies, not a network (see ``backends.algorithms``)
    one_machine: bool = False


PEER_PAGE = 256  # ranks per PeerQuery (a reply is about 25 KB: inside a control frame)


class PeerQuery(Msg):
    """A worker asks for the members of its generation with these ranks."""

    kind: Literal["peer_query"] = "peer_query"
    ranks: Annotated[list[Rank], Field(min_length=1, max_length=PEER_PAGE)]


class PeerPage(Msg):
    """The members a ``PeerQuery`` asked for, in its order."""

    kind: Literal["peer_page"] = "peer_page"
    generation: int
    members: Annotated[list[Member], Field(max_length=PEER_PAGE)] = []
