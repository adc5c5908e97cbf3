"""Options of ``shardwire worker``, ``launch`` and ``status``; each is also SHARDWIRE_<FLAG>."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardwire.protocol.errors import InvalidArgument
from shardwire.protocol.history import parse_nnodes
from shardwire.protocol.ports import coordinator_addresses, port_range, port_value
from shardwire.worker.launcher.cluster import NodePlace
from shardwire.worker.launcher.secret import job_token
from shardwire.worker.runtime.tls import TlsFiles
from shardwire.worker.runtime.worker_config import trace_switch


class _Client(BaseSettings):
    """What every command that talks to a coordinator needs: where, which job, and the
    credentials (token, TLS files)."""

    model_config = SettingsConfigDict(env_prefix="SHARDWIRE_", extra="ignore")

    coordinator: str = "127.0.0.1:29400"
    run_id: str = "shardwire"
    token: SecretStr | None = Field(
        default=None, description="The job's shared secret (or a token file)."
    )
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def coordinator_address(self) -> tuple[str, int]:
        """The coordinator's address (the first replica's, of several)."""
        return self.coordinator_addresses()[0]

    def coordinator_replicas(self) -> list[tuple[str, int]]:
        """The other replicas' addresses (``--coordinator A,B,C``: etcd's replicas)."""
        return self.coordinator_addresses()[1:]

    def coordinator_addresses(self) -> list[tuple[str, int]]:
        return coordinator_addresses(self.coordinator, "--coordinator")

    def tls_files(self) -> TlsFiles | None:
        return TlsFiles.from_values(self.tls_cert, self.tls_key, self.tls_ca)


class StatusSettings(_Client):
    """Options of ``shardwire status``."""

    status_timeout: float = Field(default=10.0, gt=0)  # the flag is --timeout
    json_output: bool = False  # the flag is --json


class LaunchSettings(_Client):
    """How to join a job and how many processes of which script to run."""

    standalone: bool = False
    nproc_per_node: int = Field(default=1, ge=1, le=1024)
    nnodes: str = "1"  # N, or MIN:MAX for an elastic job
    max_restarts: int = Field(default=0, ge=0, le=1 << 20)
    # how a rank's failure is met: keep the survivors (live), or relaunch every process
    recovery: Literal["relaunch", "live"] = "live"
    fork_ranks: bool = True  # a node's rank processes forked from one that imported ahead
    node_id: str | None = None
    node_rank: int | None = Field(default=None, ge=0, lt=1 << 24)  # the scheduler's node index
    coordinator_port: int | None = Field(default=None, ge=1, le=65535)  # where ours is served
    insecure: bool = False
    bind_host: str | None = None
    peer_port_range: str | None = None  # LOW-HIGH for the peer listeners (None: ephemeral)
    advertise_host: str | None = None
    join_timeout: float = Field(default=300.0, gt=0)
    heartbeat_timeout: float = Field(default=5.0, gt=0)
    stall_warn: float = Field(default=10.0, gt=0)
    trace: bool = False
    trace_dir: str | None = None  # None: traces/RUN_ID under the current directory
    term_timeout: float = Field(default=5.0, gt=0)
    # live recovery: after SIGTERM to the agent, its ranks' time to hand over and leave
    leave_timeout: float = Field(default=30.0, gt=0)
    chaos: str | None = None  # a fault plan's path (``shardwire chaos`` sets it too)

    @field_validator("coordinator_port", mode="before")
    @classmethod
    def _port(cls, value: object) -> object:
        return port_value(value, "SHARDWIRE_COORDINATOR_PORT")

    @field_validator("nnodes", mode="before")
    @classmethod
    def _nnodes(cls, value: object) -> str:
        text = str(value)
        parse_nnodes(text)  # raises ValueError with the reason
        return text

    @field_validator("trace", mode="before")
    @classmethod
    def _trace(cls, value: object) -> object:
        return trace_switch(value)

    def peer_ports(self) -> tuple[int, int] | None:
        """The peer port range, refused when it has fewer ports than this node's ranks."""
        if self.peer_port_range is None:
            return None
        low, high = port_range(self.peer_port_range, "--peer-port-range")
        if high - low + 1 < self.nproc_per_node:
            raise InvalidArgument(
                f"--peer-port-range {self.peer_port_range} holds {high - low + 1} port(s) "
                f"for {self.nproc_per_node} ranks on this node: each rank listens on one"
            )
        return low, high

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes; equal for a fixed-size job."""
        return parse_nnodes(self.nnodes)


def with_scheduler(
    settings: LaunchSettings, place: NodePlace | None, environ: Mapping[str, str]
) -> tuple[LaunchSettings, bool]:
    """The settings with what the scheduler says filled in where the user said nothing,
    and whether this node starts the job's coordinator (node rank 0, where the scheduler
    names the coordinator's place and no --coordinator was given)."""
    if place is None or settings.standalone:
        return settings, False
    given = settings.model_fields_set
    update: dict[str, object] = {}
    for name in ("nproc_per_node", "run_id", "node_id", "node_rank"):
        if name not in given and getattr(place, name) is not None:
            update[name] = getattr(place, name)
    if "nnodes" not in given and place.nnodes is not None:
        update["nnodes"] = str(place.nnodes)
    serve = False
    if "coordinator" not in given and place.coordinator is not None:
        host, port = place.coordinator
        update["coordinator"] = f"{host}:{settings.coordinator_port or port}"
        serve = update.get("node_rank", settings.node_rank) == 0
    if not (settings.token or settings.token_file) and place.scheduler == "slurm" and place.job_id:
        update["token"] = SecretStr(job_token(place.scheduler, place.job_id, environ))
    return settings.model_copy(update=update), serve
