"""TLS for the coordinator's listener: our certificate, and clients' signed by the CA."""

from __future__ import annotations

import ssl

from shardwire.protocol import ShardwireError


def server_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext | None:
    """The listener's context for ``--tls-cert/--tls-key/--tls-ca``, or None without."""
    given = [v for v in (cert, key, ca) if v]
    if not given:
        return None
    if len(given) != 3:
        raise ShardwireError("--tls-cert, --tls-key and --tls-ca must be given together")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        ctx.load_cert_chain(cert, key)  # type: ignore[arg-type]
    except (OSError, ssl.SSLError) as exc:
        raise ShardwireError(f"cannot load the TLS files: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: every client shows a certificate
    return ctx
