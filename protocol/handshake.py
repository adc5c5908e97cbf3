"""The authentication handshake as two pure state machines.

    client                      server
    Hello(nonce_c, who)  ──►    checks run id / role (accept callback)
                         ◄──    Challenge(nonce_s, proof_s)
    verifies proof_s
    Proof(proof_c)       ──►    verifies proof_c
                         ◄──    Welcome  |  Error(code="auth")

The server proves first so a client never sends its proof to an impostor. The IO shells
(coordinator server, control client, peer mesh) only move these messages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from shardwire.protocol.auth import Token, context_for, new_nonce
from shardwire.protocol.errors import AuthFailed, ProtocolError, RendezvousError
from shardwire.protocol.messages import Challenge, Error, Hello, Message, Proof, Welcome


class _Step(enum.Enum):
    START = enum.auto()  # nothing exchanged yet
    WAIT_CHALLENGE = enum.auto()  # client sent hello
    WAIT_PROOF = enum.auto()  # server sent challenge
    WAIT_WELCOME = enum.auto()  # client sent proof
    DONE = enum.auto()  # authenticated


def _context(hello: Hello) -> str:
    return context_for(
        run_id=hello.run_id, role=hello.role, rank=hello.rank, generation=hello.generation
    )


class ClientHandshake:
    """Client side: produces Hello, answers the Challenge, waits for Welcome."""

    def __init__(
        self,
        token: Token,
        *,
        role: str,
        run_id: str,
        rank: int = -1,
        generation: int = 0,
        min_epoch: int = 0,
    ):
        self._token = token
        self.min_epoch = min_epoch  # an older coordinator's welcome is refused (fencing)
        self.epoch = 0  # the welcoming coordinator's
        self.hello = Hello(
            role=role,  # type: ignore[arg-type]
            run_id=run_id,
            nonce=new_nonce(),
            rank=rank,
            generation=generation,
        )
        self._step = _Step.WAIT_CHALLENGE

    @property
    def done(self) -> bool:
        return self._step is _Step.DONE

    def receive(self, msg: Message) -> Message | None:
        """Feed the server's message; returns the reply to send, if any."""
        match msg, self._step:
            case Error(code=code, message=text), _:
                if code == "auth":
                    raise AuthFailed(text)
                raise RendezvousError(text, code=code)
            case Challenge(), _Step.WAIT_CHALLENGE:
                ok = self._token.verify(
                    msg.proof,
                    role="server",
                    client_nonce=self.hello.nonce,
                    server_nonce=msg.nonce,
                    context=_context(self.hello),
                )
                if not ok:
                    raise AuthFailed(
                        "the server could not prove it holds the same token; "
                        "check SHARDWIRE_TOKEN on both sides"
                    )
                self._step = _Step.WAIT_WELCOME
                return Proof(
                    proof=self._token.proof(
                        role="client",
                        client_nonce=self.hello.nonce,
                        server_nonce=msg.nonce,
                        context=_context(self.hello),
                    )
                )
            case Welcome(), _Step.WAIT_WELCOME:
                if msg.epoch < self.min_epoch:
                    raise RendezvousError(
                        f"this coordinator was deposed (its epoch {msg.epoch} is older than "
                        f"{self.min_epoch}, the leader's already followed)",
                        code="deposed",
                    )
                self.epoch = msg.epoch
                self._step = _Step.DONE
                return None
        raise ProtocolError(f"unexpected {msg.kind!r} during handshake ({self._step.name})")


class ServerHandshake:
    """Server side: accepts a Hello, issues a Challenge, verifies the Proof."""

    def __init__(self, token: Token, *, accept: Callable[[Hello], Error | None], epoch: int = 0):
        self._token = token
        self._epoch = epoch
        self._accept = accept
        self._step = _Step.START
        self._nonce = new_nonce()
        self.hello: Hello | None = None

    @property
    def done(self) -> bool:
        return self._step is _Step.DONE

    def receive(self, msg: Message) -> Message:
        """Feed the client's message; returns the reply. An ``Error`` reply means close."""
        match msg, self._step:
            case Hello(), _Step.START:
                refusal = self._accept(msg)
                if refusal is not None:
                    return refusal
                self.hello = msg
                self._step = _Step.WAIT_PROOF
                return Challenge(
                    nonce=self._nonce,
                    proof=self._token.proof(
                        role="server",
                        client_nonce=msg.nonce,
                        server_nonce=self._nonce,
                        context=_context(msg),
                    ),
                )
            case Proof(), _Step.WAIT_PROOF:
                assert self.hello is not None
                ok = self._token.verify(
                    msg.proof,
                    role="client",
                    client_nonce=self.hello.nonce,
                    server_nonce=self._nonce,
                    context=_context(self.hello),
                )
                if not ok:
                    return Error(
                        code="auth",
                        message="authentication failed: the token does not match; "
                        "check SHARDWIRE_TOKEN on both sides",
                    )
                self._step = _Step.DONE
                return Welcome(epoch=self._epoch)
        return Error(code="bad_request", message=f"unexpected {msg.kind!r} during handshake")
