"""Refused joins are logged once per address and reason per window, with the address."""

from __future__ import annotations

import logging

import pytest

from shardwire.coordinator.refusals import RefusalLog
from shardwire.protocol import ClientHandshake, Token
from shardwire.protocol.messages import Error, Join, Proof
from tests.isolation import RUN_ID
from tests.worker.cluster import TOKEN, coordinator

from .rawclient import RawClient


def test_one_line_per_address_and_reason_per_window() -> None:
    log = RefusalLog(window=10.0)
    assert (
        log.line("10.0.0.1", "auth", "bad token", now=0.0) == "refused 10.0.0.1 (auth): bad token"
    )
    assert log.line("10.0.0.1", "auth", "bad token", now=1.0) is None
    assert log.line("10.0.0.1", "auth", "bad token", now=2.0) is None
    assert log.line("10.0.0.2", "auth", "bad token", now=2.0) is not None  # another peer
    assert log.line("10.0.0.1", "run_id", "wrong run", now=2.0) is not None  # another reason
    again = log.line("10.0.0.1", "auth", "bad token", now=10.5)
    assert again == "refused 10.0.0.1 (auth): bad token (2 more like it in the last 10 s)"


def test_the_memory_of_addresses_is_bounded() -> None:
    log = RefusalLog()
    addresses = [f"10.0.{i // 256}.{i % 256}" for i in range(5000)]
    for address in addresses:
        log.line(address, "auth", "x", now=0.0)
    # the newest 1,024 are remembered (held back within the window), the older forgotten
    assert all(log.line(a, "auth", "x", now=1.0) is None for a in addresses[-1024:])
    assert log.line(addresses[0], "auth", "x", now=1.0) is not None


async def _wrong_token(address) -> None:
    client = await RawClient.open(address)
    try:
        client.send(ClientHandshake(Token("wrong"), role="worker", run_id=RUN_ID).hello)
        await client.recv()
        client.send(Proof(proof="ab" * 32))
        assert isinstance(await client.recv(), Error)
    finally:
        client.close()


async def test_repeated_refusals_are_logged_once_with_the_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="shardwire.coordinator")
    async with coordinator(2) as server:
        for _ in range(20):
            await _wrong_token(server.address)
        client = await RawClient.open(server.address)  # a join the world cannot hold
        await client.authenticate(TOKEN)
        client.send(Join(world_size=3, node_id="n", local_rank=0, local_world_size=1))
        assert isinstance(await client.recv(), Error)
        client.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    auth = [line for line in lines if "(auth)" in line]
    assert auth == [
        "refused 127.0.0.1 (auth): authentication failed: the token does not "
        "match; check SHARDWIRE_TOKEN on both sides"
    ]
    assert any("(world_size)" in line and "127.0.0.1" in line for line in lines), lines
    assert all("cluster-token" not in line for line in lines)
