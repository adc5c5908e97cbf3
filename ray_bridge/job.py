"""The driver's side of a job on a Ray cluster: place the ranks, serve the coordinator,
run every rank, and meet a lost rank with live recovery.

The driver starts the job's coordinator as its own child process (journaled, and started
again on the same address if a signal kills it), listening on the driver's node address;
the ranks dial it there. It then creates a placement group of one bundle per shardwire
node and one actor per rank in its node's bundle, each allowed ``max_restarts`` restarts.
A rank whose process dies is started again by Ray (on a live node, in its bundle); the
new process runs the rank at once (in the actor's constructor) and joins the job's next
generation as the replacement while the survivors re-form in their processes. The
driver follows each restart in Ray's actor table, says where the rank runs again, and
collects how it ended. A rank whose script fails is started again the same way; a job
the coordinator has ended (no restart left) ends here with the first failed rank's
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import ray
except ImportError as exc:  # pragma: no cover - exercised where ray is absent
    raise ImportError("shardwire on Ray needs ray: pip install 'shardwire[ray]'") from exc
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardwire.ray.errors import ClusterUnreachable, PlacementUnavailable, RayJobFailed
from shardwire.ray.layout import RankLayout
from shardwire.ray.rank import RankActor
from shardwire.worker.launcher.agent import job_env, token_env
from shardwire.worker.launcher.hosted import coordinator_command, own_coordinator
from shardwire.worker.launcher.options import LaunchSettings

# How often the driver reads a restarting actor's state: at first, and at most (the
# rank runs in the restarted actor's constructor, as long as the job).
_POLL_S = 0.25
_POLL_MAX_S = 1.0
# The longest one question to a live actor may take (it answers at once).
_ASK_S = 60.0
# How long joining a cluster may take before the driver says what may hold it.
_SLOW_CONNECT_S = 30.0
_SLOW_CONNECT = (
    "still joining the Ray cluster at {} after 30 s: a cluster whose nodes listen on "
    "127.0.0.1 is joined only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in this process's "
    "environment"
)
# After the ranks end, how long the coordinator may take to see them out.
_LINGER_S = 10.0


@dataclass(frozen=True)
class JobSpec:
    """A job for :func:`drive`: ``target`` (a script's path or a function) with ``args``
    on the ranks ``layout`` places; ``settings`` holds the run id, restarts and
    timeouts, ``env`` the user's variables for every rank."""

    target: str | Callable[..., Any]
    args: Sequence[Any]
    layout: RankLayout
    settings: LaunchSettings
    env: Mapping[str, str] = field(default_factory=dict)
    placement_timeout: float = 60.0


def connect(address: str | None, *, timeout: float = 10.0) -> None:
    """Join the Ray cluster at ``address`` (None: the one this process already joined,
    else ``RAY_ADDRESS``'s, else a new local one, as ``ray.init()`` does). A HOST:PORT
    address is first dialled within ``timeout`` seconds: Ray itself waits for minutes on
    an address where nothing answers."""
    if ray.is_initialized():
        return
    if address is not None and address != "auto":
        _dial(address, timeout)
    # Ray waits without end for a cluster it reaches at an address its nodes do not
    # use (nodes on 127.0.0.1, unless Ray is told to keep to loopback): say why, once
    hint = threading.Timer(_SLOW_CONNECT_S, _say, [_SLOW_CONNECT.format(address or "auto")])
    hint.daemon = True
    hint.start()
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        raise ClusterUnreachable(f"no Ray cluster at {address or 'auto'}: {exc}") from exc
    finally:
        hint.cancel()


def _dial(address: str, timeout: float) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnreachable(f"the Ray address {address!r} is not HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ClusterUnreachable(
            f"no Ray cluster answers at {address} (within {timeout:g} s): {exc}"
        ) from None


def _say(text: str) -> None:
    print(f"[ray]: {text}", file=sys.stderr, flush=True)


def _alive_nodes() -> dict[str, dict[str, float]]:
    return {n["NodeID"]: dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")}


async def _placed(spec: JobSpec) -> PlacementGroup:
    layout = spec.layout
    if (why := layout.shortfall(_alive_nodes())) is not None:
        raise PlacementUnavailable(
            f"{layout.num_workers} ranks, {layout.workers_per_node} per node, cannot be "
            f"placed: {why}"
        )
    group = placement_group(layout.bundles(), strategy=layout.strategy)
    try:
        async with asyncio.timeout(spec.placement_timeout):
            await group.ready()
    except TimeoutError:
        remove_placement_group(group)
        raise PlacementUnavailable(
            f"the cluster did not place the job's {layout.nodes} bundle(s) of "
            f"{layout.bundles()[0]} within {spec.placement_timeout:g} s (other work "
            "holds the resources?)"
        ) from None
    return group


@dataclass
class _Track:
    """What the driver knows of one rank's actor: its id, its current process (0
    while Ray starts it again) and node, and the restarts it has seen."""

    actor: str
    pid: int
    node: str
    restarts: int = 0


def _actor_state(actor: str) -> dict[str, Any]:
    """Ray's control store's record of actor ``actor`` now: its ``State``, its
    ``NumRestarts``, its process's ``Pid`` and ``Address``. Ray's state API reads the
    same table but needs the cluster's dashboard, which a cluster may run without."""
    from ray._private.state import actors

    return actors(actor_id=actor)


class _Job:
    """The ranks' actors and how each rank's run goes."""

    def __init__(
        self, spec: JobSpec, group: PlacementGroup, address: tuple[str, int], token: str
    ) -> None:
        self.spec = spec
        settings = spec.settings
        job = {
            **job_env(settings, address),
            "SHARDWIRE_INTERACTIVE": "0",  # the ranks' lines reach the driver through Ray
            **spec.env,
        }
        actor: Any = ray.remote(RankActor)
        layout = spec.layout
        self.actors: list[Any] = [
            actor.options(
                num_cpus=layout.cpus_per_worker,
                resources=dict(layout.resources_per_worker),
                max_restarts=settings.max_restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=layout.bundle_of(rank)
                ),
            ).remote(
                rank, layout, job, token, niceness=os.nice(0), target=spec.target, args=spec.args
            )
            for rank in range(layout.num_workers)
        ]
        self.tracks: dict[int, _Track] = {}  # by rank, once it runs

    @property
    def restarted(self) -> int:
        """Restarts of the ranks' actors, all told."""
        return sum(track.restarts for track in self.tracks.values())

    async def _ask(self, rank: int) -> dict[str, Any]:
        return await asyncio.wait_for(self.actors[rank].where.remote(), _ASK_S)

    def _failed(self, rank: int, cause: str) -> RayJobFailed:
        return RayJobFailed(rank=rank, cause=cause, run_id=self.spec.settings.run_id)

    async def rank(self, rank: int, place: dict[str, Any]) -> Any:
        """Run rank ``rank`` (its first process at ``place``) until it finishes; start
        it again while restarts last."""
        track = self.tracks[rank] = _Track(place["actor"], place["pid"], place["node"])
        while True:
            try:
                outcome = await self.actors[rank].run.remote()
            except RayActorError:
                pass  # its process ended: Ray starts the actor again, or has given up
            else:
                if outcome["ok"]:
                    return outcome["value"]
                cause = f"{outcome['error']}: {outcome['message']}\n{outcome['traceback']}"
                if outcome["over"] or track.restarts >= self.spec.settings.max_restarts:
                    raise self._failed(rank, cause)
                _say(f"rank {rank}: the script failed ({outcome['error']}); starting it again")
                ray.kill(self.actors[rank], no_restart=False)
            await self._follow(rank, track)

    async def _follow(self, rank: int, track: _Track) -> None:
        """Follow rank ``rank``'s actor through Ray's restarts (at least one more than
        ``track`` has seen) until it answers again. An actor Ray started again runs its
        rank in its constructor, so it answers once the rank has ended there; a loss of
        that process too is one more restart. Only the time no process holds the rank
        is bounded (``join_timeout``)."""
        budget, bound = self.spec.settings.max_restarts, self.spec.settings.join_timeout
        seen, pause = track.restarts, _POLL_S
        unheld_since: float | None = None
        while True:
            now = _actor_state(track.actor)
            while track.restarts < now["NumRestarts"]:
                track.restarts += 1
                lost = f"its process {track.pid} on node {track.node[:12]} ended"
                _say(f"rank {rank}: {lost}; Ray starts it again ({track.restarts} of {budget})")
                track.pid, unheld_since = 0, time.monotonic()
            if now["State"] == "DEAD":
                lost = f"its process {track.pid or now['Pid']} ended"
                left = "no restart left" if track.restarts >= budget else "Ray ended its actor"
                raise self._failed(rank, f"{lost}; {left}")
            if track.restarts > seen and not track.pid and now["Pid"]:
                track.pid, track.node = now["Pid"], now["Address"]["NodeID"]
                unheld_since = None
                _say(f"rank {rank}: back as process {track.pid} on node {track.node[:12]}")
            if track.restarts > seen and track.pid and now["State"] == "ALIVE":
                return
            if unheld_since is not None and time.monotonic() - unheld_since > bound:
                raise self._failed(
                    rank,
                    f"Ray did not start its actor again within {bound:g} s (no node with "
                    "room for its bundle?)",
                )
            await asyncio.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    async def places(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._ask(r) for r in range(len(self.actors)))))

    def end(self) -> None:
        for handle in self.actors:
            with contextlib.suppress(Exception):  # an actor already gone
                ray.kill(handle, no_restart=True)


async def drive(spec: JobSpec) -> Any:
    """Run the job; rank 0's result, or :class:`RayJobFailed` naming the first failure."""
    settings = spec.settings
    # the job's secret: the one given, else a fresh random one; it reaches the
    # coordinator through its environment and the ranks through their actors' arguments
    token = token_env(settings).get("SHARDWIRE_TOKEN") or secrets.token_hex(32)
    command = coordinator_command(settings, host=ray.util.get_node_ip_address())
    start = time.monotonic()
    group = await _placed(spec)
    try:
        async with own_coordinator(command, {"SHARDWIRE_TOKEN": token}, linger=_LINGER_S) as at:
            job = _Job(spec, group, at, token)
            try:
                results = await _ranks(job)
            finally:
                job.end()
    finally:
        remove_placement_group(group)
    _say(
        f"job {settings.run_id} finished in {time.monotonic() - start:.1f} s: "
        f"{spec.layout.num_workers} ranks on {spec.layout.nodes} node(s), "
        f"{job.restarted} rank(s) started again"
    )
    return results[0]


async def _ranks(job: _Job) -> list[Any]:
    """Every rank's run, side by side, and each one's result; the first failure ends
    the others."""
    places = await job.places()
    for place in places:
        _say(f"rank {place['rank']}: process {place['pid']} on node {place['node'][:12]}")
    results: list[Any] = [None] * len(job.actors)

    async def one(rank: int) -> None:
        results[rank] = await job.rank(rank, places[rank])

    try:
        async with asyncio.TaskGroup() as tasks:
            for rank in range(len(job.actors)):
                tasks.create_task(one(rank), name=f"shardwire-ray-rank-{rank}")
    except* RayJobFailed as failed:
        raise failed.exceptions[0] from None
    return results
