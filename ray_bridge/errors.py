"""What a job on a Ray cluster reports when it cannot start or does not finish."""

from __future__ import annotations

from shardwire.protocol import InvalidArgument, JobAborted, ShardwireError


class ClusterUnreachable(ShardwireError):
    """No Ray cluster answered at the address given (or none could be started)."""


class PlacementUnavailable(ShardwireError):
    """The cluster cannot hold the job's ranks with the resources asked for each; the
    message says what is short."""


class ScriptNotFound(InvalidArgument):
    """A rank's node cannot see the script's path (each node reads it from its own disk:
    put it on storage every node mounts, or pass a function)."""

    def __init__(self, *, rank: int, path: str, node: str) -> None:
        super().__init__(
            f"rank {rank} on Ray node {node[:12]} finds no script at {path}: every node "
            "reads the script from its own file system"
        )
        self.rank = rank
        self.path = path


class RayJobFailed(JobAborted):
    """The job ended without finishing: a rank's script failed with no restart left, or
    a rank's actor is gone for good. ``rank`` names the first rank that failed and
    ``cause`` what it raised (its type and message; the remote traceback follows)."""

    def __init__(self, *, rank: int, cause: str, run_id: str) -> None:
        super().__init__(f"job {run_id}: rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause
        self.run_id = run_id


class ScriptExit(ShardwireError):
    """A rank's script exited with a non-zero status (``sys.exit(code)``)."""

    def __init__(self, code: object) -> None:
        super().__init__(f"the script exited with status {code}")
        self.code = code
