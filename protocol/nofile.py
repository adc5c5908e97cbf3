"""Open-file limits: every peer connection, listener and shared-memory mapping of a
process holds a descriptor, so a rank of a large job needs about one per peer and a
coordinator one per worker. Linux's default soft limit (1,024) ends a job of a thousand
ranks with EMFILE half-way through forming; the hard limit is usually far higher.

:func:`plan_nofile` decides (pure); :func:`ensure_nofile` applies it at a process's
entry point: the soft limit is raised towards the hard one (every process may do that),
and a hard limit below the need is one clear error before any connection is made.
"""

from __future__ import annotations

import resource

from shardwire.protocol.errors import DescriptorLimit

# Raised to at least this (capped by the hard limit): room for the user's own files.
HEADROOM = 65536


def plan_nofile(soft: int, hard: int, needed: int, what: str) -> int:
    """The soft limit to set (``soft`` itself when it suffices); raises
    :class:`DescriptorLimit` when even ``hard`` is below ``needed``."""
    unlimited = hard == resource.RLIM_INFINITY or hard < 0
    if soft != resource.RLIM_INFINITY and soft >= 0 and soft < needed:
        if not unlimited and hard < needed:
            raise DescriptorLimit(
                f"{what} needs {needed} open files (one per peer connection and more), but "
                f"the hard limit is {hard}: raise it (`ulimit -Hn {needed}` as root, "
                f"LimitNOFILE={needed} in a systemd unit, `--ulimit nofile={needed}` in "
                "Docker, nofile in /etc/security/limits.conf)"
            )
        return max(needed, HEADROOM) if unlimited else min(hard, max(needed, HEADROOM))
    return soft


def ensure_nofile(needed: int, what: str, *, strict: bool = True) -> int:
    """Raise this process's soft RLIMIT_NOFILE to cover ``needed`` descriptors; returns
    the soft limit in force. Not ``strict`` (the need is a guess): as far as the hard
    limit allows, never an error."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not strict and hard != resource.RLIM_INFINITY:
        needed = min(needed, hard)
    target = plan_nofile(soft, hard, needed, what)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target
