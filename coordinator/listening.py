"""A coordinator's listener (its control port, its status page) that cannot open."""

from __future__ import annotations

import errno

from shardwire.protocol import InvalidArgument


def in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def refused(what: str, host: str, port: int, exc: OSError, choose: str) -> InvalidArgument:
    """The error of ``what`` failing to listen on ``host:port``, naming the flag that
    chooses another port (``choose``, with what its special values do)."""
    taken = " (another coordinator on this host?)" if in_use(exc) else ""
    return InvalidArgument(
        f"{what} cannot listen on {host}:{port}: {exc.strerror or exc}{taken}; "
        f"choose another {choose}"
    )
