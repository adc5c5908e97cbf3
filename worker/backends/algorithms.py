"""Which algorithm a collective uses, and where its messages go.

Algorithms
----------
:func:`choose` is where the links backend (``backends.peerlinks``) picks an algorithm from the
op, the payload size and the group size; its :class:`~.base.Decision` goes with the call
to the flight recorder, the trace and the benchmarks.
Up to the thresholds below the latency-optimal algorithms win. Measured with
`shardwire bench collectives` on 2 cores over loopback: all_reduce by recursive doubling vs
ring at 2 ranks: 256 KiB 230 vs 365 us, 512 KiB 359 vs 433 us, 1 MiB 1636 vs 641 us; at
4 ranks: 256 KiB 0.79 vs 2.1 ms, 1 MiB 4.5 vs 4.4 ms, 4 MiB 20 vs 14 ms. Direct exchange
beat the ring for all_gather / reduce_scatter up to 1 MiB.

A group whose ranks sit on several nodes, the same number (two or more) on each, runs
all_reduce, all_gather, reduce_scatter and broadcast in tiers (``backends.tiered``):
inside each node through the node's subgroup (its arena), across nodes only on lanes,
at every size.

Tags
----
Every data frame is routed by ``Tag(group, seq, step)``:

* ``group``: the group id (0 is the world; subgroups derive theirs from their members
  and name, unique per transport while open).
* ``seq``: the call's sequence number in its group, from 1, taken when the call is made.
  Point-to-point messages of a group use ``P2P_BASE + tag`` (user tags below 2**40), far
  above any collective's sequence number.
* ``step``: the message's place within the call. Ring and Bruck algorithms number their
  messages from 0 (Bruck's all_gather from 2^20); a call's second phase (the all-gather
  half of a large all_reduce, the gather of a large reduce) starts at ``GATHER_STEP``.
* ``seq`` 0 of a group carries poison notices (op ``__poison__``): one rank's error for
  the whole group, relayed so that every member fails the same way.
"""

from __future__ import annotations

import enum

ALL_REDUCE_SMALL = 512 * 1024
EXCHANGE_SMALL = 1 << 20
# NETWORK_EXCHANGE_PEER: across a network a direct exchange has every rank send to every
# other at once, so n - 1 flows meet at each host's link (incast) and the ring's one
# flow per link wins once the link, not the CPU, bounds the call. Measured on 4 emulated
# hosts on 1 Gbit/s links (tc tbf), bus bandwidth as a fraction of the link, same run:
# all_gather of 1 MiB (256 KiB from each rank) direct 0.84, ring 0.93-0.95 (gloo 0.91-0.93);
# reduce_scatter of 1 MiB direct 0.79, ring 0.89. On one machine over TCP (4 simulated
# nodes) the direct exchange stays ahead (all_gather of 1 MiB 2.5-2.7 ms against the
# ring's 3.6 ms): there the copies, not a link, bound the call. So across a network a
# direct exchange is used only while each rank sends each peer less than this.
NETWORK_EXCHANGE_PEER = 256 * 1024
BROADCAST_SMALL = 256 * 1024
P2P_BASE = 1 << 40
# CROWDED_BROADCAST: the pipelined chain broadcast hands every piece from rank to rank,
# so it needs every rank running at once. On a node with more ranks than CPUs the
# binomial tree (whole messages, log2 n rounds) won at every size. Measured at 4 ranks
# on 2 cores, shared memory, two runs: 1 MiB tree 0.90-1.12 ms vs chain 1.49-1.52 ms,
# 16 MiB 9.0-9.1 vs 23-24 ms, 64 MiB 46-51 vs 82-105 ms (a scatter then ring all-gather:
# 2.7-2.9, 12.6-14.1 and 47-49 ms); over TCP only, 16 MiB 19.8 vs 28.0 ms and 64 MiB
# 62.9 vs 92.8 ms.
GATHER_STEP = 1 << 30
# Scale: a direct exchange connects a rank to every other, so only small groups use it;
# a ring moves nbytes/size per hop in 2(size - 1) hops, so it is used only while a hop
# carries at least RING_MIN_HOP bytes. Otherwise the logarithmic algorithms of
# ``backends.bruck`` run (ceil(log2 n) rounds, peers at distances 2^k). At 8 ranks
# and below nothing changed: the ring's hops there are at least 64 KiB above the
# small-size thresholds.
DIRECT_MAX = 8
RING_MIN_HOP = 64 * 1024
# all_to_all above DIRECT_MAX ranks runs Bruck's index algorithm unless the caller gives
# the sizes it receives (recv_splits): every rank must choose alike from what all of
# them know, and a block's size is not that (it differs from rank to rank). A block
# crosses about log2(n)/2 links, so large exchanges should pass recv_splits, which sends
# every block straight to its rank.


class Algorithm(enum.StrEnum):
    """What :func:`choose` answers (its value is the name traces and benchmarks show)."""

    LOCAL = "local"  # a group of one: nothing moves
    TIERS = "tiers"  # a group over several nodes: node phases (``backends.tiered``)
    DOUBLING = "doubling"  # recursive doubling (all_reduce and scan, ``backends.small``)
    TREE = "tree"  # a binomial tree (``backends.small``)
    DIRECT = "direct"  # every rank to every rank at once
    RING = "ring"  # ``backends.ring``
    BRUCK = "bruck"  # logarithmic rounds (``backends.bruck``)
    CHAIN = "chain"  # a pipelined chain (broadcast, ``backends.ring``)
    DISSEMINATION = "dissemination"  # barrier rounds of empty messages (``backends.small``)
    ARENA = "arena"  # the node arena's program of the op (``arena.programs``)


def choose(
    op: str, nbytes: int, size: int, *, crowded: bool = False, network: bool = False
) -> Algorithm:
    """The algorithm the links backend runs a call of ``op`` moving ``nbytes`` (the whole
    buffer; all_gather's: the gathered buffer over ``size``, the same on every rank
    however uneven the parts) by, in a group of ``size``: local, doubling,
    ring, bruck, direct, tree or chain. ``crowded``: this node runs more ranks than it
    has CPUs (see CROWDED_BROADCAST); ``network``: the job's links cross a network (see
    NETWORK_EXCHANGE_PEER)."""
    if size == 1:
        return Algorithm.LOCAL
    ring = nbytes // size >= RING_MIN_HOP  # else a ring is many hops of a few bytes
    if op == "scan":
        return Algorithm.DOUBLING  # ceil(log2 n) rounds, every rank's payload whole
    if op in ("all_reduce", "reduce"):
        small = Algorithm.DOUBLING if op == "all_reduce" else Algorithm.TREE
        if nbytes <= ALL_REDUCE_SMALL or (op == "reduce" and not ring):
            return small
        return Algorithm.RING if ring else Algorithm.BRUCK
    if op in ("all_gather", "reduce_scatter"):
        per_peer = nbytes if op == "all_gather" else nbytes // size
        few = per_peer < NETWORK_EXCHANGE_PEER if network else nbytes <= EXCHANGE_SMALL
        if few and size <= DIRECT_MAX:
            return Algorithm.DIRECT
        return Algorithm.RING if ring else Algorithm.BRUCK
    if op == "broadcast":
        return Algorithm.TREE if nbytes <= BROADCAST_SMALL or crowded else Algorithm.CHAIN
    if op in ("gather", "scatter") and size > DIRECT_MAX:
        return Algorithm.TREE
    if op == "all_to_all" and size > DIRECT_MAX:
        return Algorithm.BRUCK  # log2 n peers; a block crosses about log2(n)/2 links
    return Algorithm.DIRECT


# The algorithms the links backend runs each op by: what a group may pin
# (``Group(algorithms=...)``) instead of :func:`choose`'s answer.
CHOICES: dict[str, frozenset[Algorithm]] = {
    "all_reduce": frozenset({Algorithm.DOUBLING, Algorithm.RING, Algorithm.BRUCK}),
    "reduce_scatter": frozenset({Algorithm.DIRECT, Algorithm.RING, Algorithm.BRUCK}),
    "all_gather": frozenset({Algorithm.DIRECT, Algorithm.RING, Algorithm.BRUCK}),
    "broadcast": frozenset({Algorithm.TREE, Algorithm.CHAIN}),
    "reduce": frozenset({Algorithm.TREE, Algorithm.RING}),
    "gather": frozenset({Algorithm.TREE, Algorithm.DIRECT}),
    "scatter": frozenset({Algorithm.TREE, Algorithm.DIRECT}),
}
