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
