"""Whether a launcher started this process: a script run by hand has no job to join and
says how to launch it at once, instead of waiting for a coordinator nobody started."""

from __future__ import annotations

from collections.abc import Mapping

from shardwire.protocol import ShardwireError

# What every launcher (shardwire's, torchrun, a scheduler's wrapper) sets; a process with
# none of them was started by hand and has no job to join.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class NotLaunched(ShardwireError):
    """The script was started without a launcher (none of ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` is set): there is no job to join. The
    message shows the command that starts it; :func:`shardwire.worker.run` prints it
    without a traceback and exits with status 2."""


def check_launched(environ: Mapping[str, str], script: str) -> None:
    """Raise :class:`NotLaunched`, showing how to launch ``script``, where no launcher
    variable is set (torch's own rendezvous, which brings rank and size itself, does
    not ask)."""
    if not any(name in environ for name in LAUNCHER_VARIABLES):
        raise NotLaunched(
            f"no launcher started this process ({', '.join(LAUNCHER_VARIABLES)} are all "
            f"unset), so there is no job to join; start it with\n"
            f"    shardwire launch --standalone --nproc-per-node 2 {script}\n"
            "or set MASTER_ADDR, MASTER_PORT and WORLD_SIZE to join a running coordinator"
        )
