"""The node arena: one shared-memory region per node and group, synchronised by flags.

Ranks of a group on one node run all_reduce, reduce_scatter, all_gather, broadcast and
barrier through it without frames or event-loop wake-ups (see ``programs`` and
``engine``); across nodes the groups keep to TCP.
"""

from shardwire.worker.transport.arena_settings import DEFAULT_SLOT_BYTES, ArenaSettings

__all__ = ["DEFAULT_SLOT_BYTES", "ArenaSettings"]
