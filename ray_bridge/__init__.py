"""shardwire jobs on a Ray cluster (``pip install shardwire[ray]``).

Each rank is a Ray actor, placed in a placement group of one bundle per shardwire node
(``workers_per_node`` ranks and their resources), running the script or function in its
own process; the driver serves the job's coordinator. A rank's process lost (killed, or
its node gone) is started again by Ray and joins the job's next generation while the
other ranks keep their processes and re-form (live recovery, as ``shardwire launch
--recovery live``), while ``max_restarts`` lasts::

    import shardwire.ray

    shardwire.ray.run("examples/digits.py", ["--steps", "200"], num_workers=4,
                      workers_per_node=2, max_restarts=3)

or ``shardwire ray --num-workers 4 --workers-per-node 2 examples/digits.py --steps 200``.
Every rank's lines reach the driver prefixed with its rank (``(rank1 pid=…)``).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardwire.ray.errors import (
    ClusterUnreachable,
    PlacementUnavailable,
    RayJobFailed,
    ScriptExit,
    ScriptNotFound,
)
from shardwire.ray.layout import RankLayout
from shardwire.worker.launcher.options import LaunchSettings

__all__ = [
    "ClusterUnreachable",
    "PlacementUnavailable",
    "RankLayout",
    "RayJobFailed",
    "ScriptExit",
    "ScriptNotFound",
    "run",
]


def run(
    target: str | Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    num_workers: int,
    workers_per_node: int = 1,
    cpus_per_worker: float = 1.0,
    resources_per_worker: Mapping[str, float] | None = None,
    strategy: str = "SPREAD",
    max_restarts: int = 0,
    address: str | None = None,
    run_id: str | None = None,
    join_timeout: float = 300.0,
    heartbeat_timeout: float = 5.0,
    placement_timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``target`` on ``num_workers`` ranks of the Ray cluster at ``address`` (None:
    the cluster this process joined, else a local one) and return rank 0's result.

    Args:
        target: a script's path (every node must see it; it runs as ``__main__`` with
            ``args`` as its command line; result 0) or a function (``target(*args)`` on
            every rank, in a job session's environment; result: its return value).
        workers_per_node: ranks per shardwire node: one placement bundle, on one host,
            sharing its node arena. Must divide ``num_workers``.
        cpus_per_worker: Ray CPUs each rank's actor holds; ``resources_per_worker``
            adds custom resources (e.g. ``{"trainer": 1}``).
        strategy: how Ray spreads the bundles (``SPREAD``, ``STRICT_SPREAD``,
            ``PACK``, ``STRICT_PACK``).
        max_restarts: failures the job recovers from live, at most (also each rank's
            actor's restarts); 0: the first failure ends the job.
        run_id: the job's name (default ``ray-`` and a random suffix).
        join_timeout: seconds the job waits for its ranks to join (and for Ray to
            start a lost one again) before it fails.
        heartbeat_timeout: a rank's silence that counts as its failure.
        placement_timeout: seconds to wait for Ray to place the bundles.
        env: variables for every rank's process.

    Raises:
        ImportError: ray is not installed (``pip install 'shardwire[ray]'``).
        ClusterUnreachable: no cluster at ``address``.
        PlacementUnavailable: the cluster cannot hold the ranks.
        RayJobFailed: the job ended unfinished; it names the first failed rank and why.
    """
    from shardwire.ray.job import JobSpec, connect, drive  # needs ray, unlike the help

    layout = RankLayout(
        num_workers=num_workers,
        workers_per_node=workers_per_node,
        cpus_per_worker=cpus_per_worker,
        resources_per_worker=dict(resources_per_worker or {}),
        strategy=strategy,
    )
    given: dict[str, Any] = {
        "nproc_per_node": num_workers,
        "max_restarts": max_restarts,
        "recovery": "live",
        "join_timeout": join_timeout,
        "heartbeat_timeout": heartbeat_timeout,
    }
    if run_id is not None:
        given["run_id"] = run_id
    settings = LaunchSettings(**given)
    if "run_id" not in settings.model_fields_set:
        settings = settings.model_copy(update={"run_id": f"ray-{secrets.token_hex(4)}"})
    connect(address)
    spec = JobSpec(
        target=target,
        args=list(args),
        layout=layout,
        settings=settings,
        env=dict(env or {}),
        placement_timeout=placement_timeout,
    )
    return asyncio.run(drive(spec))
