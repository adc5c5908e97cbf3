"""The algorithm thresholds, in one place."""

from __future__ import annotations

import pytest

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.backends.algorithms import (
    ALL_REDUCE_SMALL,
    EXCHANGE_SMALL,
    NETWORK_EXCHANGE_PEER,
    choose,
)
from shardwire.worker.collectives import roster


def test_thresholds() -> None:
    assert choose("all_reduce", 100, 1) == "local"
    assert choose("all_reduce", ALL_REDUCE_SMALL, 4) == "doubling"
    assert choose("all_reduce", ALL_REDUCE_SMALL + 1, 4) == "ring"
    assert choose("reduce", ALL_REDUCE_SMALL, 4) == "tree"
    assert choose("all_gather", EXCHANGE_SMALL, 2) == "direct"
    assert choose("reduce_scatter", EXCHANGE_SMALL + 1, 2) == "ring"
    assert choose("broadcast", 1 << 20, 2) == "chain"
    assert choose("gather", 1 << 30, 2) == "direct"


def test_across_a_network_exchanges_go_direct_only_while_each_peer_gets_little() -> None:
    peer = NETWORK_EXCHANGE_PEER
    assert choose("all_gather", peer - 4, 4, network=True) == "direct"  # each rank's part
    assert choose("all_gather", peer, 4, network=True) == "ring"
    assert choose("all_gather", peer, 4) == "direct"  # one machine: up to EXCHANGE_SMALL
    assert choose("reduce_scatter", 4 * peer - 16, 4, network=True) == "direct"
    assert choose("reduce_scatter", 4 * peer, 4, network=True) == "ring"
    assert choose("all_reduce", 64 << 20, 4, network=True) == "ring"  # others as before


def test_a_crowded_node_broadcasts_by_tree() -> None:
    assert choose("broadcast", 64 << 20, 4, crowded=True) == "tree"
    assert choose("broadcast", 64 << 20, 4, crowded=False) == "chain"
    assert choose("all_reduce", 64 << 20, 4, crowded=True) == "ring"


def test_a_pin_the_links_backend_cannot_run_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="all_reduce runs by one of bruck, doubling, ring"):
        roster.Choice.of(None, {"all_reduce": "chain"})
    with pytest.raises(InvalidArgument, match="'all_to_all' has no algorithm to pin"):
        roster.Choice.of(None, {"all_to_all": "bruck"})
    with pytest.raises(InvalidArgument, match="backend must be one of links, arena, tiered"):
        roster.Choice.of("gloo", None)
