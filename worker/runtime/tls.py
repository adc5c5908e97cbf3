"""Optional TLS for the coordinator connection and every peer connection.

Both ends present a certificate signed by the job's CA and check the other's (mutual
authentication); the token handshake still runs inside the encrypted channel. Host names
are not checked: ranks reach each other by address, and the CA plus the token are what
identify a member of the job. Files come from ``--tls-cert/--tls-key/--tls-ca`` or
``SHARDWIRE_TLS_CERT/KEY/CA``.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from shardwire.protocol import ShardwireError


class TlsConfigError(ShardwireError, ValueError):
    """The TLS options are incomplete or their files cannot be loaded."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: this process's certificate and key, and the CA that signs the job's."""

    cert: str
    key: str
    ca: str

    @classmethod
    def from_values(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """All three, or None when none is given; anything else is an error."""
        given = [v for v in (cert, key, ca) if v]
        if not given:
            return None
        if len(given) != 3:
            raise TlsConfigError("--tls-cert, --tls-key and --tls-ca must be given together")
        for path in (cert, key, ca):
            assert path is not None
            if not os.path.isfile(path):
                raise TlsConfigError(f"TLS file {path!r} does not exist")
        assert cert and key and ca
        return cls(cert, key, ca)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TlsFiles | None:
        return cls.from_values(
            environ.get("SHARDWIRE_TLS_CERT"),
            environ.get("SHARDWIRE_TLS_KEY"),
            environ.get("SHARDWIRE_TLS_CA"),
        )

    def env(self) -> dict[str, str]:
        """The environment that hands these files to a child process."""
        return {
            "SHARDWIRE_TLS_CERT": self.cert,
            "SHARDWIRE_TLS_KEY": self.key,
            "SHARDWIRE_TLS_CA": self.ca,
        }

    def server_context(self) -> ssl.SSLContext:
        """For listeners: present our certificate, require one signed by the CA."""
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """For dialers: present our certificate, require the server's signed by the CA."""
        ctx = self._context(ssl.Purpose.SERVER_AUTH)
        ctx.check_hostname = False  # ranks dial addresses; the CA and token identify them
        return ctx

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca)
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"cannot load the TLS files: {exc}") from exc
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx
