"""The peer connections' TCP tuning: their congestion control
(``MeshConfig.tcp_congestion``) and their unsent low-water mark
(``MeshConfig.tcp_notsent_lowat``). Both are the kernel's defaults unless set.

Congestion control. The kernel's default algorithm is the host's choice. On a link shaped
by a token bucket Linux's BBR leaves the link idle in gaps of a few milliseconds while
both directions are full: across two emulated hosts on a 1 Gbit/s tbf link, an all_gather
of 16 MiB took a median 78-80 ms under BBR and 71-72 ms under CUBIC (the link's payload
takes 70 ms).

Unsent low-water mark (``TCP_NOTSENT_LOWAT``). A writer is woken once the kernel holds
fewer unsent bytes than the mark, instead of once half the send buffer is free: the
kernel queues less ahead of the link, and a sender that runs ahead of its receiver (a
broadcast's root) writes in even steps. On the same links 256 KiB took the 2-host
broadcast of 1 MiB from 0.77 to 0.96 of the link under CUBIC; over loopback, where a
link moves gigabytes a second, it cost broadcasts 10-18 %, so it is not the default.

Each setting is checked once, when the rank starts listening, and refused, typed, when
the kernel cannot take it.
"""

from __future__ import annotations

import errno
import re
import socket
from pathlib import Path

from shardwire.protocol import InvalidArgument

_PROC = Path("/proc/sys/net/ipv4")
# An algorithm's name (the kernel's TCP_CA_NAME_MAX is 16, NUL included); the worker's
# environment is read with the same pattern.
ALGORITHM = r"^[a-z0-9_]{1,15}$"
_NAME = re.compile(ALGORITHM)


def _listed(name: str) -> str:
    try:
        return (_PROC / name).read_text().strip() or "(none)"
    except OSError:
        return "(unknown)"


def system_default() -> str:
    """The kernel's default congestion control for new connections ('' where unknown)."""
    listed = _listed("tcp_congestion_control")
    return "" if listed.startswith("(") else listed


def _option(name: str, what: str) -> int:
    option = getattr(socket, name, None)
    if option is None:
        raise InvalidArgument(f"{what}: this platform cannot set it per connection (Linux)")
    return int(option)


def check(congestion: str | None, notsent_lowat: int | None = None) -> None:
    """Refuse settings this kernel cannot give a connection (tried on a socket)."""
    if congestion is not None:
        _check_congestion(congestion)
    if notsent_lowat is not None:
        what = f"TCP unsent low-water mark {notsent_lowat}"
        if notsent_lowat < 1:
            raise InvalidArgument(f"{what}: give a byte count of at least 1")
        option = _option("TCP_NOTSENT_LOWAT", what)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.setsockopt(socket.IPPROTO_TCP, option, notsent_lowat)
            except OSError as exc:
                raise InvalidArgument(f"{what}: the kernel refused it ({exc.strerror})") from exc


def _check_congestion(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"TCP congestion control {name!r}: a kernel algorithm's name, such as cubic, "
            "of at most 15 lowercase letters, digits or underscores"
        )
    option = _option("TCP_CONGESTION", f"TCP congestion control {name!r}")
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


def apply(sock: socket.socket, congestion: str | None, notsent_lowat: int | None) -> None:
    """Give ``sock`` (a connected TCP socket) the settings (checked beforehand)."""
    if congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    if notsent_lowat is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, notsent_lowat)


def used(sock: socket.socket) -> dict[str, object]:
    """What ``sock`` uses: its congestion control and unsent low-water mark."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    lowat = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
    return {"congestion": raw.split(b"\0", 1)[0].decode(), "notsent_lowat": lowat}
