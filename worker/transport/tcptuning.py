"""The peer connections' TCP tuning: their congestion control
(``MeshConfig.tcp_congestion``) and their unsent low-water mark
(``MeshConfig.tcp_notsent_lowat``).

Theory of operation
-------------------
A connection between two hosts gets CUBIC and an unsent low-water mark of 256 KiB; a
connection that stays on this machine (its remote address is a loopback address or one
of this machine's own) keeps the kernel's defaults. :meth:`TcpPlan.for_connection` decides
per connection from the connected socket's two addresses. A setting given explicitly
applies to every connection instead: an algorithm's name, or ``kernel`` (``KERNEL``) for
the kernel's own; a byte count, or 0 for the kernel's own (Linux reads 0 the same way).

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
link moves gigabytes a second, it cost broadcasts 10-18 %, so connections on one machine
go without it.

:func:`plan` runs once, when the rank starts listening: an explicit setting the kernel
cannot take is refused, typed; where this kernel does not give CUBIC to this process
(``tcp_allowed_congestion_control`` without it, and no root), the automatic choice is
the kernel's algorithm, so the default never fails a job.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from shardwire.protocol import InvalidArgument

_PROC = Path("/proc/sys/net/ipv4")
_NET = Path("/proc/net")
# An algorithm's name (the kernel's TCP_CA_NAME_MAX is 16, NUL included); the worker's
# environment is read with the same pattern.
ALGORITHM = r"^[a-z0-9_]{1,15}$"
_NAME = re.compile(ALGORITHM)
KERNEL = "kernel"  # the congestion control setting that keeps the kernel's algorithm


@dataclass(frozen=True, slots=True)
class Tuning:
    """One connection's TCP settings; None leaves that setting to the kernel."""

    congestion: str | None = None
    notsent_lowat: int | None = None


@dataclass(frozen=True, slots=True)
class TcpPlan:
    """What a rank's peer connections get, settled when it starts listening.

    Attributes:
        congestion: as asked: None for the automatic choice, ``KERNEL``, or a name.
        notsent_lowat: as asked: None for the automatic choice, 0 (the kernel's), or bytes.
        between_hosts: the automatic choice for a connection to another host on this
            kernel (CUBIC where it gives it, and the 256 KiB mark).
        own: this machine's addresses (canonical text, see :func:`canonical`).
    """

    congestion: str | None = KERNEL
    notsent_lowat: int | None = 0
    between_hosts: Tuning = Tuning()
    own: frozenset[str] = frozenset()

    def for_connection(self, local: str, remote: str) -> Tuning:
        """The settings of a connection from address ``local`` to ``remote``."""
        auto = Tuning() if same_machine(local, remote, self.own) else self.between_hosts
        congestion = auto.congestion if self.congestion is None else self.congestion
        lowat = auto.notsent_lowat if self.notsent_lowat is None else self.notsent_lowat
        return Tuning(None if congestion == KERNEL else congestion, lowat or None)


UNTUNED = TcpPlan()  # every connection on the kernel's defaults
# Measured best between hosts on 1 Gbit/s links (see above).
BETWEEN_HOSTS = Tuning("cubic", 256 * 1024)


def canonical(address: str) -> str | None:
    """An IP address as one text per address (IPv4-mapped IPv6 as IPv4, no scope);
    None for what is not an IP address."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def same_machine(local: str, remote: str, own: Collection[str]) -> bool:
    """Whether a connection from ``local`` to ``remote`` stays on this machine: the
    remote address is a loopback address, the connection's own local address, or one of
    ``own``. What is not an IP address counts as this machine (the kernel's defaults)."""
    there = canonical(remote)
    if there is None:
        return True
    return ipaddress.ip_address(there).is_loopback or there == canonical(local) or there in own


def addresses_listed(fib_trie: str, if_inet6: str) -> frozenset[str]:
    """This machine's addresses from ``/proc/net/fib_trie`` (an address followed by a
    ``/32 host LOCAL`` line) and ``/proc/net/if_inet6`` (32 hex digits a line)."""
    found: set[str] = set()
    last = ""
    for line in fib_trie.splitlines():
        words = line.split()
        if words[:1] == ["|--"] and len(words) == 2:
            last = words[1]
        elif words == ["/32", "host", "LOCAL"] and last:
            found.add(last)
    for line in if_inet6.splitlines():
        words = line.split()
        if words and len(words[0]) == 32:
            found.add(str(ipaddress.IPv6Address(int(words[0], 16))))
    return frozenset(a for a in map(canonical, found) if a is not None)


def own_addresses() -> frozenset[str]:
    """This machine's addresses (its network namespace's), empty where /proc has none."""
    texts = []
    for name in ("fib_trie", "if_inet6"):
        try:
            texts.append((_NET / name).read_text())
        except OSError:
            texts.append("")
    return addresses_listed(*texts)


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


def _probe(option: int, value: int | bytes) -> None:
    """Set ``option`` on a fresh socket (raises the kernel's OSError)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.IPPROTO_TCP, option, value)


def usable(congestion: str) -> bool:
    """Whether this kernel gives ``congestion`` to this process's connections."""
    try:
        _check_congestion(congestion)
    except InvalidArgument:
        return False
    return True


def plan(
    congestion: str | None, notsent_lowat: int | None, *, between_hosts: Tuning = BETWEEN_HOSTS
) -> TcpPlan:
    """The rank's plan for its peer connections from what was asked (None: automatic,
    ``between_hosts`` for a connection to another host, as far as this kernel gives it
    to this process); refuses, typed, an explicit setting it cannot give a connection."""
    check(congestion, notsent_lowat)
    lowat_settable = getattr(socket, "TCP_NOTSENT_LOWAT", None) is not None
    wanted, mark = between_hosts.congestion, between_hosts.notsent_lowat
    between = Tuning(
        wanted if congestion is None and wanted is not None and usable(wanted) else None,
        mark if notsent_lowat is None and lowat_settable else None,
    )
    automatic = congestion is None or notsent_lowat is None
    own = own_addresses() if automatic else frozenset()
    return TcpPlan(congestion, notsent_lowat, between, own)


def check(congestion: str | None, notsent_lowat: int | None = None) -> None:
    """Refuse settings this kernel cannot give a connection (tried on a socket). None
    (automatic), ``KERNEL`` and a mark of 0 (the kernel's) are always taken."""
    if congestion is not None and congestion != KERNEL:
        _check_congestion(congestion)
    if notsent_lowat:
        what = f"TCP unsent low-water mark {notsent_lowat}"
        if notsent_lowat < 0:
            raise InvalidArgument(f"{what}: give a byte count, or 0 for the kernel's default")
        try:
            _probe(_option("TCP_NOTSENT_LOWAT", what), notsent_lowat)
        except OSError as exc:
            raise InvalidArgument(f"{what}: the kernel refused it ({exc.strerror})") from exc


def _check_congestion(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(
            f"TCP congestion control {name!r}: a kernel algorithm's name, such as cubic, "
            "of at most 15 lowercase letters, digits or underscores, or kernel for the "
            "kernel's default"
        )
    try:
        _probe(_option("TCP_CONGESTION", f"TCP congestion control {name!r}"), name.encode())
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


def apply(sock: socket.socket, tuning: Tuning) -> None:
    """Give ``sock`` (a connected TCP socket) ``tuning`` (checked beforehand)."""
    if tuning.congestion is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, tuning.congestion.encode())
    if tuning.notsent_lowat is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, tuning.notsent_lowat)


def tune(sock: socket.socket, chosen: TcpPlan) -> Tuning:
    """Give ``sock`` (a connected TCP socket) what ``chosen`` gives its addresses."""
    tuning = chosen.for_connection(str(sock.getsockname()[0]), str(sock.getpeername()[0]))
    apply(sock, tuning)
    return tuning


def used(sock: socket.socket) -> dict[str, object]:
    """What ``sock`` uses: its congestion control and unsent low-water mark (0: none of
    its own, the system's ``net.ipv4.tcp_notsent_lowat``)."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    lowat = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
    return {"congestion": raw.split(b"\0", 1)[0].decode(), "notsent_lowat": lowat}
