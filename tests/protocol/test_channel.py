"""The sans-IO connection: two sessions joined by byte strings, no socket. Handshake,
events in order, what is refused before and after authentication, held handshakes, and
the limits that apply once the peer is known."""

from __future__ import annotations

import pytest

from shardwire.protocol import (
    AuthFailed,
    ClientHandshake,
    FrameKind,
    FrameTooLarge,
    Limits,
    ProtocolError,
    ServerHandshake,
    Token,
    encode_head,
    message_bytes,
)
from shardwire.protocol.channel import AUTHENTICATED, Channel, HandshakeRefused
from shardwire.protocol.messages import Error, Leave

LIMITS = Limits(max_payload=1 << 20)


def _client(token: str = "t") -> Channel:
    return Channel(ClientHandshake(Token(token), role="peer", run_id="r", rank=1), limits=LIMITS)


def _server(token: str = "t", **kw) -> Channel:
    landed: list[bytearray] = []

    def allocate(header):
        landed.append(bytearray(header.payload_len))
        return memoryview(landed[-1])

    session = Channel(
        ServerHandshake(Token(token), accept=lambda _hello: None),
        limits=LIMITS,
        allocator=allocate,
        peer="127.0.0.1",
        **kw,
    )
    session.landed = landed  # type: ignore[attr-defined]
    return session


def _connect(client: Channel, server: Channel) -> list:
    """Pass bytes both ways until neither has any; the events each saw, in order."""
    seen: list = []
    for _ in range(4):  # hello, challenge, proof, welcome
        seen += [("server", e) for e in server.receive_data(client.data_to_send())]
        seen += [("client", e) for e in client.receive_data(server.data_to_send())]
    return seen


def test_a_handshake_in_bytes_authenticates_both_ends_once() -> None:
    client, server = _client(), _server()
    assert not client.authenticated and not server.authenticated
    seen = _connect(client, server)
    assert seen == [("server", AUTHENTICATED), ("client", AUTHENTICATED)]
    assert client.authenticated and server.authenticated
    assert client.data_to_send() == server.data_to_send() == b""


def test_after_the_handshake_messages_and_tensors_come_out_in_order() -> None:
    client, server = _client(), _server()
    _connect(client, server)
    payload = bytes(range(200)) * 5
    wire = (
        message_bytes(Leave())
        + encode_head(FrameKind.DATA, {"n": 1}, len(payload))
        + payload
        + message_bytes(Error(code="x", message="after the handshake an error is a message"))
    )
    # one byte at a time: nothing depends on how the kernel cuts the stream
    events = [e for i in range(len(wire)) for e in server.receive_data(wire[i : i + 1])]
    assert [getattr(e, "kind", None) for e in events] == ["leave", FrameKind.DATA, "error"]
    assert bytes(events[1].payload) == payload == bytes(server.landed[0])  # type: ignore[attr-defined]


def test_messages_and_tensors_before_the_handshake_are_violations() -> None:
    with pytest.raises(ProtocolError, match="'leave' before the handshake finished"):
        _server().receive_data(message_bytes(Leave()))
    with pytest.raises(ProtocolError, match="data before the handshake finished"):
        _server().receive_data(encode_head(FrameKind.DATA, {"n": 1}, 0))
    with pytest.raises(FrameTooLarge):  # handshake limits: no payload at all
        _server().receive_data(encode_head(FrameKind.DATA, {"n": 1}, 8) + bytes(8))


def test_a_handshake_message_after_authentication_is_a_violation() -> None:
    client, server = _client(), _server()
    _connect(client, server)
    with pytest.raises(ProtocolError, match="'hello' after authentication"):
        server.receive_data(message_bytes(client.handshake.hello))


def test_a_server_with_another_token_is_refused_by_the_client() -> None:
    client, server = _client("a"), _server("b")
    server.receive_data(client.data_to_send())
    with pytest.raises(AuthFailed, match="could not prove"):
        client.receive_data(server.data_to_send())
    assert not server.authenticated and not client.authenticated


def test_a_proof_with_the_wrong_token_is_refused_with_its_reply_queued() -> None:
    honest, server = _client("b"), _server("b")
    server.receive_data(honest.data_to_send())
    challenge = server.data_to_send()
    honest.receive_data(challenge)
    proof = honest.data_to_send()
    # the same proof replayed to a fresh server (another nonce) is refused
    fresh = _server("b")
    fresh.receive_data(message_bytes(honest.handshake.hello))
    fresh.data_to_send()
    with pytest.raises(HandshakeRefused, match="refused peer at 127.0.0.1") as caught:
        fresh.receive_data(proof)
    assert caught.value.reply.code == "auth"
    told = _client("b")
    with pytest.raises(AuthFailed):  # what the fresh server queued is that refusal
        told.handshake.receive(caught.value.reply)
    assert fresh.data_to_send() == message_bytes(caught.value.reply)
    assert not fresh.authenticated


def test_a_held_handshake_is_answered_when_released() -> None:
    holding = [True]
    client, server = _client(), _server(hold=lambda: holding[0])
    assert server.receive_data(client.data_to_send()) == []
    assert server.data_to_send() == b""  # nothing answered while held
    with pytest.raises(ProtocolError, match="more than one handshake message"):
        _held = _server(hold=lambda: True)
        _held.receive_data(message_bytes(client.handshake.hello) * 2)
    holding[0] = False
    assert server.release_held() is None  # the challenge goes out; not done yet
    client.receive_data(server.data_to_send())
    assert server.receive_data(client.data_to_send()) == [AUTHENTICATED]


def test_the_connection_limits_apply_once_authenticated() -> None:
    client, server = _client(), _server()
    big = encode_head(FrameKind.DATA, {"n": 1}, 1 << 20) + bytes(1 << 20)
    _connect(client, server)
    (frame,) = server.receive_data(big)
    assert len(frame.payload) == 1 << 20
    with pytest.raises(FrameTooLarge):
        server.receive_data(encode_head(FrameKind.DATA, {"n": 1}, (1 << 20) + 1))
