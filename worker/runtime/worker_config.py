"""Worker configuration: an explicit frozen config, and how to read it from the launcher's
environment (torchrun's variables plus ``SHARDWIRE_*``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator

from shardwire.protocol import InvalidArgument, Token
from shardwire.protocol.auth import is_loopback, load_token
from shardwire.protocol.ports import coordinator_addresses, port_range
from shardwire.worker.runtime.tls import TlsFiles
from shardwire.worker.transport import tcptuning
from shardwire.worker.transport.arena_settings import DEFAULT_SLOT_BYTES

_SWITCH_WORDS = {"0", "1", "off", "on", "f", "t", "false", "true", "n", "y", "no", "yes"}


def trace_switch(value: object) -> object:
    """``SHARDWIRE_TRACE`` is a switch; a directory there (its meaning once) is refused
    with the variable that takes it now."""
    if isinstance(value, str) and value.strip().lower() not in _SWITCH_WORDS:
        raise InvalidArgument(
            f"SHARDWIRE_TRACE={value!r}: SHARDWIRE_TRACE is 1 or 0 (trace or not); "
            "a directory goes in SHARDWIRE_TRACE_DIR"
        )
    return value


def _alias(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class WorkerEnv(BaseModel):
    """The environment contract between ``shardwire worker``/``launch`` and a script."""

    model_config = ConfigDict(extra="ignore")

    rank: int | None = Field(
        default=None,
        ge=0,
        validation_alias=_alias("RANK"),
        description="Requested global rank (unset: the coordinator assigns one).",
    )
    world_size: int = Field(
        default=1,
        ge=1,
        validation_alias=_alias("WORLD_SIZE"),
        description="Worker processes in the job.",
    )
    local_rank: int = Field(
        default=0,
        ge=0,
        validation_alias=_alias("LOCAL_RANK"),
        description="This process's index on its node.",
    )
    local_world_size: int | None = Field(
        default=None,
        validation_alias=_alias("LOCAL_WORLD_SIZE"),
        description="Processes per node (unset: the world size).",
    )
    master_addr: str = Field(
        default="127.0.0.1",
        validation_alias=_alias("MASTER_ADDR"),
        description="The coordinator's host (torchrun's name for it).",
    )
    master_port: int = Field(
        default=29400, validation_alias=_alias("MASTER_PORT"), description="The coordinator's port."
    )
    coordinator_replicas: str = Field(
        default="",
        validation_alias=_alias("SHARDWIRE_COORDINATOR_REPLICAS"),
        description="Set by the node agent: the other coordinator replicas' HOST:PORT, "
        "comma-separated (etcd); each is dialed in turn, and the leader answers.",
    )
    run_id: str = Field(
        default="shardwire",
        validation_alias=_alias("SHARDWIRE_RUN_ID"),
        description="The job's id: every connection and shared-memory name carries it.",
    )
    # set by the node agent: the generation this process was started for (0: any)
    generation: int = Field(
        default=0,
        ge=0,
        validation_alias=_alias("SHARDWIRE_GENERATION"),
        description="The generation the node agent started this process for (0: whichever forms).",
    )
    recovery: Literal["relaunch", "live"] = Field(
        default="relaunch",
        validation_alias=_alias("SHARDWIRE_RECOVERY"),
        description="How the node agent answers a rank's failure: keep the survivors, which "
        "re-form in their processes (live), or relaunch every process. The agent sets it "
        "from --recovery (whose default is live); a worker started without one relaunches.",
    )
    token: SecretStr | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TOKEN"),
        description="The job's shared secret; required off loopback.",
    )
    token_file: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TOKEN_FILE"),
        description="A file holding the shared secret (mode 0600).",
    )
    node_id: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_NODE_ID"),
        description="This node's id (default: the host name); its ranks share memory.",
    )
    bind_host: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_BIND_HOST"),
        description="The peer listener's address (default: loopback; every address with a token).",
    )
    peer_port_range: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_PEER_PORT_RANGE"),
        description="Ports LOW-HIGH the peer listeners take (one per rank of a node; "
        "unset: ephemeral), for a firewall.",
    )
    advertise_host: str = Field(
        default="",
        validation_alias=_alias("SHARDWIRE_ADVERTISE_HOST"),
        description="The address peers dial (default: the one reaching the coordinator).",
    )
    insecure: bool = Field(
        default=False,
        validation_alias=_alias("SHARDWIRE_INSECURE"),
        description="Allow a listener off loopback without a token.",
    )
    heartbeat_interval: float = Field(
        default=1.0,
        gt=0,
        validation_alias=_alias("SHARDWIRE_HEARTBEAT_INTERVAL"),
        description="Seconds between heartbeats (sent from a thread of their own).",
    )
    join_timeout: float = Field(
        default=300.0,
        gt=0,
        validation_alias=_alias("SHARDWIRE_JOIN_TIMEOUT"),
        description="Seconds to wait for the coordinator and for the job to form.",
    )
    connect_timeout: float = Field(
        default=60.0,
        gt=0,
        validation_alias=_alias("SHARDWIRE_CONNECT_TIMEOUT"),
        description="Seconds to connect to a peer (on first use), retries included.",
    )
    idle_close: float = Field(
        default=120.0,
        ge=0,
        validation_alias=_alias("SHARDWIRE_IDLE_CLOSE"),
        description="Close a peer connection idle this many seconds (0: never).",
    )
    timeout: float = Field(
        default=300.0,
        gt=0,
        validation_alias=_alias("SHARDWIRE_TIMEOUT"),
        description="Default bound of every collective and transport operation, in seconds.",
    )
    stall_warn: float = Field(
        default=10.0,
        gt=0,
        validation_alias=_alias("SHARDWIRE_STALL_WARN"),
        description="Seconds without the event loop running before the rank is shown busy.",
    )
    interactive: bool = Field(
        default=False,
        validation_alias=_alias("SHARDWIRE_INTERACTIVE"),
        description="A person watches on a terminal (progress bar instead of log lines).",
    )
    checksum: bool = Field(
        default=True,
        validation_alias=_alias("SHARDWIRE_CHECKSUM"),
        description="Checksum every data frame (xxh3-64); the same on every rank.",
    )
    transport: Literal["auto", "tcp"] = Field(
        default="auto",
        validation_alias=_alias("SHARDWIRE_TRANSPORT"),
        description="auto: shared memory between ranks of a node; tcp: sockets only.",
    )
    shm_slots: int = Field(
        default=4,
        ge=1,
        le=1024,
        validation_alias=_alias("SHARDWIRE_SHM_SLOTS"),
        description="Slots of each per-pair shared-memory segment.",
    )
    shm_slot_bytes: int = Field(
        default=1 << 20,
        ge=4096,
        le=1 << 30,
        validation_alias=_alias("SHARDWIRE_SHM_SLOT_BYTES"),
        description="Bytes of each slot of a per-pair segment.",
    )
    busy_poll_us: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        validation_alias=_alias("SHARDWIRE_BUSY_POLL_US"),
        description="Microseconds a small wait polls before it sleeps (unset: by CPUs).",
    )
    arena_slot_bytes: int = Field(
        default=DEFAULT_SLOT_BYTES,
        ge=16384,
        le=1 << 30,
        validation_alias=_alias("SHARDWIRE_ARENA_SLOT_BYTES"),
        description="Each local rank's slot in a node arena, in bytes.",
    )
    arena_peer_reads: Literal["auto", "on", "off"] = Field(
        default="auto",
        validation_alias=_alias("SHARDWIRE_ARENA_PEER_READS"),
        description="A node arena's all_gather of parts of 256 KiB or more reads them from "
        "their owners' memory: auto where the node has a CPU per local rank, on, off.",
    )
    tcp_congestion: str | None = Field(
        default=None,
        pattern=tcptuning.ALGORITHM,
        validation_alias=_alias("SHARDWIRE_TCP_CONGESTION"),
        description="TCP congestion control of every peer connection: an algorithm such "
        "as cubic, or kernel for the kernel's default (unset: cubic on a connection to "
        "another host where the kernel allows it, the kernel's default on this machine).",
    )
    tcp_notsent_lowat: int | None = Field(
        default=None,
        ge=0,
        le=1 << 30,
        validation_alias=_alias("SHARDWIRE_TCP_NOTSENT_LOWAT"),
        description="Unsent bytes the kernel holds before a peer connection's writer is "
        "woken (TCP_NOTSENT_LOWAT), on every peer connection; 0: the kernel's default "
        "(unset: 262144 on a connection to another host, the kernel's default on this "
        "machine).",
    )
    trace: bool = Field(
        default=False,
        validation_alias=_alias("SHARDWIRE_TRACE"),
        description="Record this rank's timeline (Chrome trace events) into SHARDWIRE_TRACE_DIR.",
    )
    trace_dir: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TRACE_DIR"),
        description="Where SHARDWIRE_TRACE writes (unset: traces/RUN_ID in the current directory).",
    )

    @field_validator("trace", mode="before")
    @classmethod
    def _trace(cls, value: object) -> object:
        return trace_switch(value)

    agent_beats: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_AGENT_BEATS"),
        description="Set by the node agent: its local socket, through which this worker's "
        "heartbeats reach the coordinator batched per node (unset: sent directly).",
    )
    tls_cert: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TLS_CERT"),
        description="TLS certificate (PEM) for coordinator and peer connections.",
    )
    tls_key: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TLS_KEY"),
        description="TLS private key (PEM).",
    )
    tls_ca: str | None = Field(
        default=None,
        validation_alias=_alias("SHARDWIRE_TLS_CA"),
        description="CA bundle (PEM) that peers' certificates must chain to.",
    )


@dataclass(frozen=True)
class WorkerConfig:
    """Everything :func:`shardwire.worker.init` needs, passed explicitly.

    Attributes:
        coordinator: (host, port) of the coordinator.
        coordinator_replicas: the (host, port) of its other replicas (etcd), if any: the
            control connection dials each in turn and follows the one that leads.
        world_size: total number of worker processes.
        local_rank: this process's index on its node.
        local_world_size: processes per node.
        rank: requested global rank, or None to let the coordinator assign one.
        token: shared secret (``Token(None)`` for none; only allowed on loopback).
        bind_host: address of the peer listener; advertise_host overrides what peers dial.
        peer_ports: (LOW, HIGH), the ports the peer listener may take (the first free one
            from LOW + local_rank on, wrapping), so a firewall can admit them; None: an
            ephemeral port.
        timeout: default bound for every collective and transport operation, in seconds.
        connect_timeout: bound on connecting to a peer (made on first use), in seconds.
        idle_close: a peer connection nothing moved on for about this many seconds is
            closed, both ranks agreeing (the next send dials again); 0: never.
        heartbeat_interval: seconds between heartbeats (sent from a thread of their own).
        stall_warn: seconds without the event loop running before the rank is reported
            busy (with its stack) on the status views; a busy rank is never failed.
        checksum: data frames carry an xxh3-64 checksum of meta and payload, verified on
            arrival (a mismatch raises IntegrityError on every rank of the group). Every
            rank must use the same setting.
        transport: "auto" runs the collectives of a group whose ranks share a node (same
            node id) through a node arena in shared memory, and moves other payloads of
            128 KiB and more between ranks on the same node through per-pair segments;
            "tcp" keeps every byte on the peer connections.
        shm_slots, shm_slot_bytes: each shared-memory direction between two ranks is a
            segment of this many slots of this many bytes (reserved in ``/dev/shm``).
        arena_slot_bytes: each local rank's slot in a node arena (used as two halves of
            double buffering); a group of k ranks on a node reserves k slots plus 4 KiB
            and 512 bytes per rank in ``/dev/shm``, once, when its first collective runs.
        arena_peer_reads: a node arena's all_gather of parts of 256 KiB or more reads them
            from their owners' memory (one copy, not two) where the system allows it:
            "auto" on a node with a usable CPU per local rank, "on" always, "off" never.
        busy_poll_us: a receive of at most 64 KiB, or a node-arena wait, that has to
            wait polls this many microseconds before the process sleeps, which
            saves the kernel's wake-up latency on small messages. None: 100 when this node has at
            least as many usable CPUs as ranks, else 0 (polling would take the core
            another rank needs; set explicitly there, it yields the CPU on every turn).
        tcp_congestion, tcp_notsent_lowat: the TCP congestion control and unsent
            low-water mark in bytes of every peer connection (Linux; checked when the rank
            starts listening); "kernel" and 0 keep the kernel's defaults. None: a
            connection to another host gets CUBIC (where the kernel gives it to this
            process) and 262144, one on this machine the kernel's defaults (see the
            slow-links guide).
        tls: certificate, key and CA for TLS on the coordinator and peer connections
            (mutual authentication), or None for plain TCP.
        generation: the generation the node agent started this process for; the
            coordinator refuses it once that generation is over (0: whichever forms).
        recovery: "live" when the node agent keeps this process through another rank's
            failure: the script re-forms with ``Session.reform``; "relaunch": the agent
            replaces every process of the job.
        agent_beats: the node agent's local socket for heartbeats (set by the agent,
            with ``rank`` and ``generation``): this worker's heartbeats go there and the
            agent forwards its node's together; None, or the agent unreachable: they go
            to the coordinator.
        trace: a directory for this rank's timeline (``rank-R.json``, Chrome's
            trace-event format) and, from rank 0, the merged ``job.json``; None: no
            timeline (see ``shardwire.worker.observe.trace``).
    """

    coordinator: tuple[str, int]
    world_size: int
    coordinator_replicas: tuple[tuple[str, int], ...] = ()
    local_rank: int = 0
    local_world_size: int = 1
    rank: int | None = None
    run_id: str = "shardwire"
    token: Token = field(default_factory=lambda: Token(None))
    node_id: str = field(default_factory=socket.gethostname)
    bind_host: str = "127.0.0.1"
    peer_ports: tuple[int, int] | None = None
    advertise_host: str = ""
    insecure: bool = False
    heartbeat_interval: float = 1.0
    join_timeout: float = 300.0
    connect_timeout: float = 60.0
    idle_close: float = 120.0
    timeout: float = 300.0
    stall_warn: float = 10.0
    interactive: bool = False
    checksum: bool = True
    transport: Literal["auto", "tcp"] = "auto"
    shm_slots: int = 4
    shm_slot_bytes: int = 1 << 20
    busy_poll_us: int | None = None
    arena_slot_bytes: int = DEFAULT_SLOT_BYTES
    arena_peer_reads: Literal["auto", "on", "off"] = "auto"
    tcp_congestion: str | None = None
    tcp_notsent_lowat: int | None = None
    tls: TlsFiles | None = None
    generation: int = 0
    recovery: Literal["relaunch", "live"] = "relaunch"
    trace: str | None = None
    agent_beats: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerConfig:
        """Read the launcher's environment contract. A field of the same name in
        :class:`WorkerEnv` and here is copied as is; only the fields below are derived."""
        env = WorkerEnv.model_validate(dict(environ))
        token = load_token(env.token.get_secret_value() if env.token else None, env.token_file)
        bind = env.bind_host or ("127.0.0.1" if is_loopback(env.master_addr) else "0.0.0.0")
        derived = dict(
            coordinator=(env.master_addr, env.master_port),
            coordinator_replicas=tuple(
                coordinator_addresses(env.coordinator_replicas, "SHARDWIRE_COORDINATOR_REPLICAS")
                if env.coordinator_replicas
                else ()
            ),
            local_world_size=env.local_world_size or env.world_size,
            token=token,
            node_id=env.node_id or socket.gethostname(),
            bind_host=bind,
            trace=(env.trace_dir or str(Path("traces") / env.run_id)) if env.trace else None,
            peer_ports=(
                port_range(env.peer_port_range, "SHARDWIRE_PEER_PORT_RANGE")
                if env.peer_port_range
                else None
            ),
            tls=TlsFiles.from_values(env.tls_cert, env.tls_key, env.tls_ca),
        )
        same = {f.name for f in fields(cls)} & set(WorkerEnv.model_fields) - set(derived)
        return cls(**{name: getattr(env, name) for name in same}, **derived)  # type: ignore[arg-type]
