"""Port settings read from the environment, where Kubernetes may have put something else."""

from __future__ import annotations

from shardwire.protocol.errors import InvalidArgument


def port_value(value: object, setting: str) -> object:
    """``value`` unchanged, unless it is a Kubernetes service link: a Service named like a
    setting's prefix (``shardwire``, ``shardwire-coordinator``) makes Kubernetes set
    ``SHARDWIRE_PORT``/``SHARDWIRE_COORDINATOR_PORT`` to ``tcp://ADDRESS:PORT`` in every
    pod of the namespace. Refused with the reason instead of a bare type error."""
    if isinstance(value, str) and value.startswith(("tcp://", "udp://", "sctp://")):
        raise InvalidArgument(
            f"{setting}={value!r} is a Kubernetes service link, not a port: a Service of "
            "that name exists in the namespace; set enableServiceLinks: false in the pod "
            "spec (shardwire kubernetes does) or give the port as a flag"
        )
    return value


def port_range(text: str, setting: str) -> tuple[int, int]:
    """``"A-B"`` (or one port ``"A"``) as ``(A, B)``: the ports a firewall admits for a
    kind of listener. Refused, naming ``setting``, unless 1 <= A <= B <= 65535."""
    low_text, sep, high_text = text.strip().partition("-")
    high_text = high_text if sep else low_text
    if not (low_text.strip().isdigit() and high_text.strip().isdigit()):
        raise InvalidArgument(
            f"{setting} must be PORT or LOW-HIGH (e.g. 29500-29563), got {text!r}"
        )
    low, high = int(low_text), int(high_text)
    if not 1 <= low <= high <= 65535:
        raise InvalidArgument(
            f"{setting} must run from a lower to a higher port within 1-65535, got {text!r}"
        )
    return low, high


def coordinator_addresses(text: str, what: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]`` as addresses (of a coordinator's replicas)."""
    out = []
    for part in text.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise InvalidArgument(f"{what} must be HOST:PORT[,HOST:PORT...], got {text!r}")
        out.append((host.strip("[]"), int(port)))
    return out
