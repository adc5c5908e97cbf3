"""A worker or agent whose coordinator does not answer yet keeps retrying, and says so
every few seconds instead of waiting in silence."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from shardwire.protocol import Token
from shardwire.worker.runtime.control import ControlClient, CoordinatorUnreachable
from tests.isolation import RUN_ID


def _refused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections to it are refused


async def test_retries_to_a_refused_address_are_said_and_end_with_one_error(caplog) -> None:
    port = _refused_port()
    client = ControlClient(token=Token("t"), run_id=RUN_ID, role="worker")
    caplog.set_level(logging.WARNING, logger="shardwire.worker")
    try:
        with pytest.raises(CoordinatorUnreachable, match=f"at 127.0.0.1:{port} within 1.5 s"):
            await client.connect("127.0.0.1", port, timeout=1.5, note_every=0.2)
    finally:
        await client.aclose()
    notes = [r.getMessage() for r in caplog.records if "waiting for the coordinator" in r.message]
    assert len(notes) >= 2, notes
    expected = f"worker: waiting for the coordinator at 127.0.0.1:{port} (Connection refused)"
    assert expected in notes[0]
    assert "of 1.5 s" in notes[0]


async def test_a_prompt_answer_is_not_announced(caplog) -> None:
    port = _refused_port()
    client = ControlClient(token=Token("t"), run_id=RUN_ID, role="worker")
    caplog.set_level(logging.WARNING, logger="shardwire.worker")
    try:
        with pytest.raises(CoordinatorUnreachable):
            await client.connect("127.0.0.1", port, timeout=0.5, note_every=30.0)
    finally:
        await client.aclose()
    assert not [r for r in caplog.records if "waiting for the coordinator" in r.getMessage()]


async def test_a_coordinator_that_accepts_but_never_answers_is_waited_for_aloud(caplog) -> None:
    # as an attempt that hangs (a firewall dropping the port answers nothing at all)
    server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = ControlClient(token=Token("t"), run_id=RUN_ID, role="agent")
    caplog.set_level(logging.WARNING, logger="shardwire.worker")
    try:
        with pytest.raises(CoordinatorUnreachable, match="no answer yet"):
            await client.connect("127.0.0.1", port, timeout=1.5, note_every=0.2)
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    notes = [r.getMessage() for r in caplog.records if "waiting for the coordinator" in r.message]
    assert len(notes) >= 3, notes
    assert f"agent: waiting for the coordinator at 127.0.0.1:{port} (no answer yet)" in notes[0]


async def test_a_job_that_does_not_form_is_waited_for_aloud(caplog) -> None:
    from shardwire.protocol import RendezvousError
    from shardwire.protocol.messages import Join
    from tests.worker.cluster import TOKEN, coordinator

    caplog.set_level(logging.WARNING, logger="shardwire.worker")
    async with coordinator(2) as server:  # a job of two; only one process joins
        host, port = server.address
        client = ControlClient(token=TOKEN, run_id=RUN_ID, role="worker")
        try:
            await client.connect(host, port, timeout=10)
            join = Join(
                world_size=2,
                node_id="n",
                local_rank=0,
                local_world_size=2,
                listen_host="",
                listen_port=1,
                requested_rank=None,
            )
            with pytest.raises(RendezvousError):
                await client.join(join, timeout=1.5, note_every=0.2)
        finally:
            await client.aclose()
    notes = [r.getMessage() for r in caplog.records if "waiting for the job to form" in r.message]
    assert len(notes) >= 3, notes
    assert (
        f"worker: waiting for the job to form at {host}:{port} (joined, world size 2)" in (notes[0])
    )
    assert "are the job's other processes started?" in notes[0]
