"""How groups on one node use a node arena (a plain value; no imports of the engine)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SLOT_BYTES = 4 << 20
# ``nap`` on a node with more ranks than CPUs. Measured at 4 ranks on 2 cores, 4 KiB
# all_reduce: 290-420 us against 580-630 us handing every wait to the engine's thread.
CROWDED_NAP = 1e-3
SLOT_SETTING = "SHARDWIRE_ARENA_SLOT_BYTES"
READS_SETTING = "SHARDWIRE_ARENA_PEER_READS"


@dataclass(frozen=True, slots=True)
class ArenaSettings:
    """Whether and how groups on one node use a node arena.

    Attributes:
        run_id: names the region (the node agent sweeps the run's names).
        slot_bytes: each local rank's slot (two halves); the region is k slots plus a
            control page and a 512-byte row per rank.
        spin: seconds a wait polls on the event loop before the engine's thread takes
            over and sleeps on the futex (0 on a node with more ranks than CPUs).
        yield_cpu: polls hand the CPU to another process between looks.
        nap: seconds a call run at once (``Gate.express``) may then sleep on the futex
            on the event loop's thread before the engine's thread takes over: on a node
            with more ranks than CPUs this skips two thread hand-offs per wait.
        peer_reads: an all_gather of large parts copies each part straight from its
            owner's memory (``arena.peerread``) where the system allows it: "on", "off",
            or "auto": on where the node has a usable CPU per local rank (``yield_cpu``
            is False); on a crowded node the wait for every reader costs more than the
            copy it saves.
    """

    run_id: str
    slot_bytes: int = DEFAULT_SLOT_BYTES
    spin: float = 100e-6
    yield_cpu: bool = False
    nap: float = 0.0
    peer_reads: str = "auto"

    def reads(self) -> bool:
        """Whether this rank lets its arena's peers read its memory (``peer_reads``)."""
        return self.peer_reads == "on" or (self.peer_reads == "auto" and not self.yield_cpu)
