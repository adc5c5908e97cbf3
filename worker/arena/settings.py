"""How groups on one node use a node arena (a plain value; no imports of the engine)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SLOT_BYTES = 4 << 20
SLOT_SETTING = "SHARDWIRE_ARENA_SLOT_BYTES"


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
    """

    run_id: str
    slot_bytes: int = DEFAULT_SLOT_BYTES
    spin: float = 100e-6
    yield_cpu: bool = False
