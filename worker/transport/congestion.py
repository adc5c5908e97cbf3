"""The TCP congestion control of the peer connections (``MeshConfig.tcp_congestion``).

The kernel's default algorithm is the host's choice, and usually the right one. On a
link shaped by a token bucket (an emulated or policed link) Linux's BBR leaves the link
idle in gaps of a few milliseconds while both directions are full: measured across two
emulated hosts on a 1 Gbit/s tbf link, an all_gather of 16 MiB took a median 78-80 ms
under BBR and 71-72 ms under CUBIC (the link's payload takes 70 ms). A job can name
the algorithm of its peer connections; the name is checked once, when the rank starts
listening, and refused, typed, with the kernel's list when the kernel cannot use it.
"""

from __future__ import annotations

import errno
import re
import socket
from pathlib import Path

from shardwire.protocol import InvalidArgument

_PROC = Path("/proc/sys/net/ipv4")
_NAME = re.compile(r"[a-z0-9_]{1,15}")  # the kernel's TCP_CA_NAME_MAX is 16, NUL included


def _listed(name: str) -> str:
    try:
        return (_PROC / name).read_text().strip() or "(none)"
    except OSError:
        return "(unknown)"


def system_default() -> str:
    """The kernel's default congestion control for new connections ('' where unknown)."""
    listed = _listed("tcp_congestion_control")
    return "" if listed.startswith("(") else listed


def check(name: str) -> None:
    """Refuse ``name`` unless this kernel lets a connection use it (tried on a socket)."""
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"TCP congestion control {name!r}: a kernel algorithm's name, such as cubic, "
            "of at most 15 lowercase letters, digits or underscores"
        )
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        raise InvalidArgument(
            f"TCP congestion control {name!r}: this platform cannot choose it per "
            "connection (Linux only)"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.setsockopt(socket.IPPROTO_TCP, option, name.encode())
        except OSError as exc:
            why: dict[int | None, str] = {
                errno.ENOENT: "the kernel has no such algorithm (module not loaded?)",
                errno.EPERM: "only root may use an algorithm the host does not allow",
            }
            said = why.get(exc.errno, str(exc.strerror))
            raise InvalidArgument(
                f"TCP congestion control {name!r}: {said}; "
                f"available: {_listed('tcp_available_congestion_control')}, allowed to "
                f"every user: {_listed('tcp_allowed_congestion_control')}"
            ) from exc


def apply(sock: socket.socket, name: str) -> None:
    """Make ``sock`` (a connected TCP socket) use ``name`` (checked beforehand)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def used(sock: socket.socket) -> str:
    """The congestion control ``sock`` uses."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    return raw.split(b"\0", 1)[0].decode()
