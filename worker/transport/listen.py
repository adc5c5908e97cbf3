"""Where a rank's peer listener binds: an ephemeral port by default, or a free port of a
range that a firewall admits (``--peer-port-range``).

The ranks of a node share the range. Each starts its search at its own local rank's
place in the range, so with a range of at least one port per local rank and nothing
else on those ports, local rank i binds ``LOW + i`` at the first try; a port taken by
another process (or a previous generation's listener still closing) is skipped.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from typing import Any

from shardwire.protocol import ShardwireError


class ListenFailed(ShardwireError):
    """This rank could not open its peer listener: every port of its range was taken,
    or the address cannot be bound (the message names the address and the ports)."""


async def bind_listener(
    factory: Callable[[], asyncio.BaseProtocol],
    host: str,
    *,
    ports: tuple[int, int] | None,
    first: int = 0,
    **kwargs: Any,
) -> asyncio.Server:
    """A server for ``factory`` on ``host``: on an ephemeral port when ``ports`` is None,
    else on the first free port of ``ports`` (inclusive) from offset ``first`` on,
    wrapping around. Raises :class:`ListenFailed` naming the range when none is free."""
    loop = asyncio.get_running_loop()
    if ports is None:
        return await loop.create_server(factory, host, 0, **kwargs)
    low, high = ports
    count = high - low + 1
    for i in range(count):
        port = low + (first + i) % count
        try:
            return await loop.create_server(factory, host, port, **kwargs)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ListenFailed(
                    f"cannot listen for peers on {host}:{port} (from the peer port range "
                    f"{low}-{high}): {exc.strerror or exc}"
                ) from exc
    raise ListenFailed(
        f"no free port for the peer listener on {host} in the peer port range {low}-{high}: "
        f"all {count} are in use; each rank of a node needs one (--peer-port-range, "
        "SHARDWIRE_PEER_PORT_RANGE)"
    )
