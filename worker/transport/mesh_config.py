"""The TCP mesh's settings (a plain value: ``api`` makes it from a WorkerConfig)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from shardwire.protocol import Token
from shardwire.worker.transport.arena_settings import DEFAULT_SLOT_BYTES


@dataclass(frozen=True, slots=True)
class MeshConfig:
    """How a rank's TCP mesh listens, authenticates, checks and moves its payloads."""

    run_id: str
    token: Token
    bind_host: str = "127.0.0.1"
    listen_ports: tuple[int, int] | None = None  # the listener's: ephemeral, or LOW-HIGH
    connect_timeout: float = 30.0
    max_payload: int = 1 << 32
    # Before authentication a connection costs a decoder buffer and a slot: it gets
    # handshake_timeout seconds to prove itself, and at most max_unauthenticated of them
    # are open at once (further ones are closed on arrival).
    handshake_timeout: float = 10.0
    max_unauthenticated: int = 512  # above the largest burst of legitimate dialers
    # A connection nothing moved on for about this many seconds is closed (both ranks
    # agreeing; the next send dials again). 0: never.
    idle_close: float = 0.0
    # Data frames carry an xxh3-64 checksum of meta and payload, verified on arrival.
    checksum: bool = True
    # TLS (mutual): the listener's context and the dialer's, or None for plain TCP.
    tls_server: ssl.SSLContext | None = None
    tls_client: ssl.SSLContext | None = None
    # Peers on the same node (by placement) move payloads of 128 KiB and more through a
    # shared-memory segment per direction of shm_slots x shm_slot_bytes, if it attaches;
    # it is offered with the first such payload (collectives on one node use the arena).
    shm: bool = False
    shm_slots: int = 4
    shm_slot_bytes: int = 1 << 20
    # A waiting receive keeps the loop polling this many microseconds before it sleeps
    # (None: 100 when this node's ranks have a core each, else 0; see transport.poll).
    busy_poll_us: int | None = None
    # Groups whose ranks all share this node run their collectives through a node arena
    # (see ArenaSettings: slot_bytes, peer_reads).
    arena: bool = False
    arena_slot_bytes: int = DEFAULT_SLOT_BYTES
    arena_peer_reads: str = "auto"
    # The peer connections' TCP congestion control and unsent low-water mark in bytes
    # (transport.tcptuning), for every connection: "kernel" and 0 keep the kernel's;
    # None: CUBIC and 256 KiB on a connection to another host, the kernel's on this one.
    tcp_congestion: str | None = None
    tcp_notsent_lowat: int | None = None
