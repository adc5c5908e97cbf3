"""HMAC-SHA256 challenge-response, pure functions.

Both sides contribute a fresh nonce; each side proves knowledge of the token over both
nonces and a context string (run id, and for peers generation and ranks), with a role
label so a proof can never be reflected back. Replaying a recorded proof fails because
the other side's nonce is new every time. Comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat

from shardwire.protocol.errors import ShardwireError

NONCE_BYTES = 32


class Token:
    """A shared secret that never shows up in reprs, logs or error messages."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes | None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        self._key = secret or b""

    @property
    def present(self) -> bool:
        return bool(self._key)

    def proof(self, *, role: str, client_nonce: str, server_nonce: str, context: str) -> str:
        """HMAC over both nonces and the context, labelled with who is proving."""
        message = "\x1f".join(("shardwire-auth-v1", role, client_nonce, server_nonce, context))
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()

    def verify(
        self, proof: str, *, role: str, client_nonce: str, server_nonce: str, context: str
    ) -> bool:
        expected = self.proof(
            role=role, client_nonce=client_nonce, server_nonce=server_nonce, context=context
        )
        return hmac.compare_digest(expected.encode(), proof.encode())

    def __repr__(self) -> str:
        return "Token(<set>)" if self._key else "Token(<none>)"

    __str__ = __repr__


def new_nonce() -> str:
    """A fresh random nonce as hex."""
    return secrets.token_hex(NONCE_BYTES)


def context_for(*, run_id: str, role: str, rank: int = -1, generation: int = 0) -> str:
    """The string both proofs bind to, so a proof for one run or rank is useless for another."""
    return f"{run_id}\x1f{role}\x1f{rank}\x1f{generation}"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_token(secret: str | None, path: str | None) -> Token:
    """The token from an explicit value or a file (first line, whitespace stripped)."""
    if secret:
        return Token(secret)
    if path:
        return Token(read_token_file(path))
    return Token(None)


def read_token_file(path: str) -> str:
    """The first line of a token file, refused when it is empty, when others may change
    it, or when it is yours and every user may read it (``chmod 600`` is the fix). A file
    of another owner (a secret the container runtime mounted) is taken as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ShardwireError(f"cannot read the token file {path}: {exc.strerror}") from None
    with os.fdopen(fd, encoding="utf-8") as fh:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH) or (
            info.st_uid == os.getuid() and mode & stat.S_IROTH
        ):
            raise ShardwireError(
                f"the token file {path} is open to other users (mode {mode:04o}): chmod 600 {path}"
            )
        token = fh.readline().strip()
    if not token:
        raise ShardwireError(f"the token file {path} is empty")
    return token


def check_bind(host: str, token: Token, *, insecure: bool, what: str) -> None:
    """Refuse to listen on a non-loopback address without a token unless told to."""
    if token.present or insecure or is_loopback(host):
        return
    raise ShardwireError(
        f"refusing to bind the {what} to {host} without a token: set SHARDWIRE_TOKEN "
        "(or --token-file), or pass --insecure to accept unauthenticated peers"
    )
