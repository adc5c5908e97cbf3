"""A control connection given a coordinator's replicas: it finds the one that listens,
refuses a replica of another job by name, and never follows a coordinator older than
one it already followed (fencing by epoch)."""

from __future__ import annotations

import pytest

from shardwire.protocol import RendezvousError
from shardwire.worker.runtime.control import ControlClient
from shardwire.worker.runtime.dialer import Dialer
from tests.etcdserver import free_ports
from tests.worker.cluster import TOKEN, coordinator


async def test_of_its_replicas_the_client_follows_the_one_that_listens() -> None:
    down = free_ports(2)  # standbys do not listen
    async with coordinator(run_id="test") as server:
        host, port = server.address
        client = ControlClient(token=TOKEN, run_id="test", role="client")
        try:
            replicas = [("127.0.0.1", down[1]), (host, port)]
            await client.connect("127.0.0.1", down[0], timeout=20, replicas=replicas)
            assert client.where == f"{host}:{port}"
        finally:
            await client.aclose()


async def test_a_replica_of_another_job_is_refused_by_its_address() -> None:
    async with coordinator(run_id="other") as stray, coordinator(run_id="test") as right:
        client = ControlClient(token=TOKEN, run_id="test", role="client")
        try:
            with pytest.raises(RendezvousError, match="wrong run id") as caught:
                await client.connect(*stray.address, timeout=20, replicas=[right.address])
        finally:
            await client.aclose()
    assert caught.value.code == "run_id"
    assert str(caught.value).startswith(f"{stray.address[0]}:{stray.address[1]}: ")


async def test_a_coordinator_older_than_the_leader_followed_is_refused_as_deposed() -> None:
    opened = []
    dialer = Dialer(
        token=TOKEN,
        role="client",
        run_id="test",
        generation=0,
        tls=None,
        on_message=lambda _msg: None,
        opened=opened.append,
        dialed=lambda _proto: None,
    )
    async with coordinator(run_id="test", epoch=7) as leader:
        async with coordinator(run_id="test", epoch=5) as deposed:
            try:
                dialer.addresses = [leader.address]
                await dialer.dial_any()
                assert dialer.epoch == 7
                dialer.addresses = [deposed.address]
                with pytest.raises(RendezvousError, match="epoch 5 is older than 7") as caught:
                    await dialer.dial_any()
                assert caught.value.code == "deposed"
                dialer.addresses = [deposed.address, leader.address]
                await dialer.dial_any()  # of the two, the leader
                assert dialer.where == f"{leader.address[0]}:{leader.address[1]}"
            finally:
                for proto in opened:
                    if proto is not None:
                        proto.close()
