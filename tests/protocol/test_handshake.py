"""The HMAC challenge-response: success, wrong token, replay, reflection, secrecy."""

from __future__ import annotations

import pytest

from shardwire.protocol import AuthFailed, ClientHandshake, ServerHandshake, Token
from shardwire.protocol.messages import Error, Proof, Welcome


def _accept_all(_hello):
    return None


def run(client: ClientHandshake, server: ServerHandshake):
    challenge = server.receive(client.hello)
    proof = client.receive(challenge)
    return server.receive(proof)


def test_matching_tokens_authenticate_both_ways() -> None:
    client = ClientHandshake(Token("s3cret"), role="worker", run_id="r")
    server = ServerHandshake(Token("s3cret"), accept=_accept_all)
    reply = run(client, server)
    assert isinstance(reply, Welcome)
    client.receive(reply)
    assert client.done and server.done


def test_wrong_token_on_the_server_is_caught_by_the_client_first() -> None:
    client = ClientHandshake(Token("a"), role="worker", run_id="r")
    server = ServerHandshake(Token("b"), accept=_accept_all)
    with pytest.raises(AuthFailed, match="server could not prove"):
        client.receive(server.receive(client.hello))
    assert not server.done


def test_forged_proof_is_refused() -> None:
    client = ClientHandshake(Token("a"), role="worker", run_id="r")
    server = ServerHandshake(Token("a"), accept=_accept_all)
    server.receive(client.hello)
    reply = server.receive(Proof(proof="00" * 32))
    assert isinstance(reply, Error) and reply.code == "auth"
    assert not server.done


def test_replayed_handshake_admits_no_one() -> None:
    token = Token("a")
    client = ClientHandshake(token, role="worker", run_id="r")
    first = ServerHandshake(token, accept=_accept_all)
    proof = client.receive(first.receive(client.hello))
    assert isinstance(first.receive(proof), Welcome)
    # An eavesdropper replays the recorded hello and proof to a new connection.
    second = ServerHandshake(token, accept=_accept_all)
    second.receive(client.hello)
    reply = second.receive(proof)
    assert isinstance(reply, Error) and reply.code == "auth"


def test_server_proof_cannot_be_reflected_as_a_client_proof() -> None:
    token = Token("a")
    client = ClientHandshake(token, role="worker", run_id="r")
    server = ServerHandshake(token, accept=_accept_all)
    challenge = server.receive(client.hello)
    reply = server.receive(Proof(proof=challenge.proof))
    assert isinstance(reply, Error) and reply.code == "auth"


def test_proof_is_bound_to_rank_and_generation() -> None:
    token = Token("a")
    honest = ClientHandshake(token, role="peer", run_id="r", rank=1, generation=1)
    server = ServerHandshake(token, accept=_accept_all)
    challenge = server.receive(honest.hello)
    proof = honest.receive(challenge)
    other = ServerHandshake(token, accept=_accept_all)
    forged_hello = honest.hello.model_copy(update={"rank": 2})
    other._nonce = server._nonce  # even with the same server nonce
    other.receive(forged_hello)
    assert isinstance(other.receive(proof), Error)


def test_token_never_appears_in_reprs() -> None:
    token = Token("hunter2-very-secret")
    client = ClientHandshake(token, role="worker", run_id="r")
    for text in (repr(token), str(token), repr(client.hello), repr(client.__dict__)):
        assert "hunter2" not in text


def test_refusal_from_accept_is_returned() -> None:
    server = ServerHandshake(Token("a"), accept=lambda h: Error(code="run_id", message="no"))
    client = ClientHandshake(Token("a"), role="worker", run_id="r")
    assert server.receive(client.hello) == Error(code="run_id", message="no")
