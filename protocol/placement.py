"""Where a worker stands in its generation, and the members as pages (messages whose
size does not grow with the job)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardwire.protocol.fields import Msg, Rank, Size, Str


class Member(Msg):
    """One roster entry."""

    rank: Rank
    node_id: Str
    node_rank: Rank
    local_rank: Rank
    host: Str
    port: Annotated[int, Field(ge=0, le=65535)]


class Placement(Msg):
    """To every worker once its generation formed: its place, in a few numbers whatever
    the job's size. The peers' addresses come page by page (``PeerQuery``)."""

    kind: Literal["placement"] = "placement"
    rank: Rank
    world_size: Size
    generation: int


PEER_PAGE = 256  # members per PeerPage (about 25 KB: inside a control frame)


class PeerQuery(Msg):
    """A worker asks for the members of its generation from rank ``offset`` on."""

    kind: Literal["peer_query"] = "peer_query"
    offset: Annotated[int, Field(ge=0)] = 0
    limit: Annotated[int, Field(ge=1, le=PEER_PAGE)] = PEER_PAGE


class PeerPage(Msg):
    """Members ``offset`` onwards of the asking worker's generation, by rank."""

    kind: Literal["peer_page"] = "peer_page"
    generation: int
    offset: int
    members: Annotated[list[Member], Field(max_length=PEER_PAGE)] = []


class Roster(BaseModel):
    """The complete world as a worker holds it, assembled from its placement and the
    pages of members (never one message: it grows with the job)."""

    model_config = ConfigDict(frozen=True)

    rank: Rank
    world_size: Size
    generation: int
    members: list[Member]
