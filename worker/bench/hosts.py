"""Emulated hosts for benchmarks: Linux network namespaces on a bridge, each host's link
shaped to a rate in both directions with ``tc`` tbf (root only).

Each host is a namespace with one veth into a hub namespace holding a bridge. What a
host sends is shaped on its own end of the veth; what it receives is shaped on the hub's
end, so a host sends at most the rate and receives at most the rate at the same time, as
a full-duplex NIC does. tbf shapes the rate only: this kernel has no netem, so there is
no added delay or loss, and a link's round trip is the bridge's (tens of microseconds);
a real switch adds its own latency, and a link across zones adds milliseconds.

Names carry the creating process's PID, so two benchmarks never share a namespace, and
everything made is removed on the way out, whatever happened.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from shardwire.protocol.errors import InvalidArgument
from shardwire.worker.bench import BenchmarkFailed

SUBNET = "10.79.0"  # the hosts' addresses: SUBNET.1 onwards
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate: str) -> float:
    """A tc-style rate (``100mbit``, ``1gbit``, ``2.5gbit``) in bits per second."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate.strip().lower())
    if found is None:
        raise InvalidArgument(f"link rate {rate!r}: give a number and kbit, mbit or gbit")
    bits = float(found.group(1)) * _UNITS[found.group(2)]
    if bits <= 0:
        raise InvalidArgument(f"link rate {rate!r} must be above zero")
    return bits


def tbf_rule(device: str, rate: str) -> list[str]:
    """``tc`` arguments shaping ``device``'s egress to ``rate`` with a token bucket.

    The bucket holds 4 ms at the rate (at least 64 KiB, so one segment that the veth
    offloads whole passes), and at most 20 ms of packets wait in the queue before
    drops: enough for TCP to fill the link without a standing queue that inflates the
    round trip."""
    bucket = max(64 * 1024, int(rate_bits(rate) / 8 * 0.004))
    return [
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        str(bucket),
        "latency",
        "20ms",
    ]


def _run(*cmd: str) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=20)
    except subprocess.CalledProcessError as exc:
        why = exc.stderr.decode(errors="replace").strip()
        raise BenchmarkFailed(f"{' '.join(cmd)} failed: {why}") from exc


class Hosts:
    """``count`` emulated hosts; ``prefix(i)`` runs a command inside host ``i``."""

    def __init__(self, count: int, rate: str | None, *, subnet: str = SUBNET) -> None:
        if count < 2:
            raise InvalidArgument(f"--hosts needs at least 2 hosts, got {count}")
        if rate is not None:
            rate_bits(rate)
        self.count = count
        self.rate = rate
        self.subnet = subnet
        tag = os.getpid() % 100000
        self.hub = f"swbhub{tag}"
        self.names = [f"swb{i}x{tag}" for i in range(count)]
        self._inner = [f"swb{i}i{tag}"[:15] for i in range(count)]
        self._outer = [f"swb{i}o{tag}"[:15] for i in range(count)]
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def device(self, i: int) -> str:
        """Host ``i``'s network interface (inside its namespace)."""
        return self._inner[i]

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def open(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            raise BenchmarkFailed("--hosts needs root and iproute2 (ip, tc)")
        self._add(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            self._add(name)
            inner, outer = self._inner[i], self._outer[i]
            _run(
                "ip",
                "link",
                "add",
                inner,
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                outer,
                "netns",
                self.hub,
            )
            _run("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", outer, "up")
            _run("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", inner)
            _run("ip", "-n", name, "link", "set", inner, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            if self.rate is not None:  # sending on the host's end, receiving on the hub's
                _run("ip", "netns", "exec", name, "tc", *tbf_rule(inner, self.rate))
                _run("ip", "netns", "exec", self.hub, "tc", *tbf_rule(outer, self.rate))

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Remove every namespace made (their veths and qdiscs go with them)."""
        for name in reversed(self._made):
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=20
            )
        self._made.clear()


@contextmanager
def emulated(count: int, rate: str | None) -> Iterator[Hosts]:
    """``count`` hosts on links of ``rate`` (None: unshaped) while the block runs."""
    hosts = Hosts(count, rate)
    try:
        hosts.open()
        yield hosts
    finally:
        hosts.close()
