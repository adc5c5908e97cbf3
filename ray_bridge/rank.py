"""One rank of a job, as a Ray actor: the rank's script or function runs in the actor's
own process, so Ray's view of the actor is the rank's (a killed rank is a dead actor,
which Ray starts again, and the job's live recovery admits it into the next
generation). An actor Ray started again runs its rank at once, in its constructor: the
replacement joins as soon as its process is up, not once the driver has learnt of the
loss (Ray tells the driver a second or more after it restarted the actor).

The token reaches the actor as an argument of its constructor, which Ray keeps to start
it again; it is never a runtime environment's variable (Ray shows those) or on a command
line. The actor sets it in its own environment only, for the script's session to read.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from shardwire.protocol import JobAborted, PeerFailed
from shardwire.ray.errors import ScriptExit, ScriptNotFound
from shardwire.ray.layout import RankLayout, rank_env
from shardwire.ray.priority import run_at


class RankActor:
    """Rank ``rank`` of a job laid out as ``layout``; ``job`` holds the job's variables
    (the coordinator's address, run id, recovery, the user's), ``token`` its secret,
    ``niceness`` the CPU priority its process runs at (see :mod:`shardwire.ray.priority`)
    and ``target`` with ``args`` what the rank runs (see :meth:`run`)."""

    def __init__(
        self,
        rank: int,
        layout: RankLayout,
        job: Mapping[str, str],
        token: str,
        *,
        niceness: int,
        target: str | Callable[..., Any],
        args: Sequence[Any],
    ) -> None:
        if (held := run_at(niceness, rank)) is not None:
            print(f"shardwire: {held}", file=sys.stderr, flush=True)
        self.rank = rank
        self.target = target
        self.args = list(args)
        self.layout = layout
        self.job = dict(job)
        self.token = token
        # Ray's actor processes write to files: a line reaches the driver as it is printed
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(line_buffering=True)
        # The rank's runtime, imported while Ray starts the actor: the driver learns
        # where the first ranks run meanwhile, and a rank joins as soon as it is run.
        importlib.import_module("shardwire.worker")
        # How the rank ended in this process, until the driver asks (``run``).
        self.ended: dict[str, Any] | None = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            # Ray started the actor again after a loss: the rank runs now, in the
            # constructor (on the main thread, where the script takes its signals),
            # as the replacement the surviving ranks wait for. The driver learns of the
            # loss only when Ray tells it, a second or more later.
            node = ray.get_runtime_context().get_node_id()
            print(
                f"shardwire: rank {rank} runs again as process {os.getpid()} on Ray node "
                f"{node[:12]}",
                file=sys.stderr,
                flush=True,
            )
            self.ended = self._run()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return f"rank{self.rank}"

    def where(self) -> dict[str, Any]:
        """This rank's actor and process: their ids and its Ray node."""
        context = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "actor": context.get_actor_id(),
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
        }

    def run(self) -> dict[str, Any]:
        """How the rank ended in this process: run now, or, in an actor Ray started
        again, already run by the constructor."""
        if self.ended is None:
            return self._run()
        ended, self.ended = self.ended, None
        return ended

    def _run(self) -> dict[str, Any]:
        """Run the rank: the script at ``target`` as ``__main__`` with ``args`` as its
        command line (its value: 0), or ``target(*args)`` (its value). How it ended, as
        plain data (``ok``, ``value``; or ``error``, ``message``, ``traceback`` and
        ``over``: whether the job itself is over, so no restart of this rank helps)."""
        node = ray.get_runtime_context().get_node_id()
        env = rank_env(
            self.layout,
            self.rank,
            job=self.job,
            ray_node=node,
            host=ray.util.get_node_ip_address(),
        )
        os.environ.update(env)
        os.environ["SHARDWIRE_TOKEN"] = self.token
        try:
            if callable(self.target):
                value = self.target(*self.args)
            else:
                value = _script(Path(self.target), [str(a) for a in self.args], self.rank, node)
        except Exception as exc:  # the driver decides what a failure means for the job
            over = isinstance(exc, JobAborted | ScriptNotFound) and not isinstance(exc, PeerFailed)
            return {
                "ok": False,
                "error": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
                "over": over,
            }
        return {"ok": True, "value": value}


def _script(path: Path, args: list[str], rank: int, node: str) -> int:
    """``python path args``, in this process: the script's folder first on the import
    path (its sibling modules import), its arguments as ``sys.argv``."""
    if not path.is_file():
        raise ScriptNotFound(rank=rank, path=str(path), node=node)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent.absolute()))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise ScriptExit(done.code) from None
    return 0
