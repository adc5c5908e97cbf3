"""Where a job's ranks go on a Ray cluster, and what each rank's process is told.

Pure: no Ray, no I/O. A job of ``num_workers`` ranks is ``num_workers /
workers_per_node`` shardwire nodes; each node is one placement-group bundle holding the
resources of its ranks, so Ray keeps a node's ranks on one host and moves them together
when that host is lost. Rank ``r`` is local rank ``r % K`` of node ``r // K`` (torchrun's
layout). A rank's shardwire node id names its Ray node and its bundle: two bundles Ray
packs onto one host are two shardwire nodes there, each with its own node arena, so the
ids are right wherever Ray puts the bundles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shardwire.protocol import InvalidArgument

STRATEGIES = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")


@dataclass(frozen=True)
class RankLayout:
    """``num_workers`` ranks, ``workers_per_node`` to a bundle, each with
    ``cpus_per_worker`` CPUs and ``resources_per_worker`` of Ray's custom resources."""

    num_workers: int
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    resources_per_worker: Mapping[str, float] = field(default_factory=dict)
    strategy: str = "SPREAD"

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise InvalidArgument(f"num_workers is {self.num_workers}: a job has 1 rank or more")
        if self.workers_per_node < 1 or self.num_workers % self.workers_per_node:
            raise InvalidArgument(
                f"workers_per_node {self.workers_per_node} does not divide num_workers "
                f"{self.num_workers}: every node runs the same number of ranks"
            )
        if self.cpus_per_worker < 0 or any(v < 0 for v in self.resources_per_worker.values()):
            raise InvalidArgument("a worker's resources are 0 or more")
        if self.strategy not in STRATEGIES:
            raise InvalidArgument(
                f"placement strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}"
            )

    @property
    def nodes(self) -> int:
        return self.num_workers // self.workers_per_node

    def per_worker(self) -> dict[str, float]:
        """One rank's resources, as Ray names them."""
        wanted = dict(self.resources_per_worker)
        if self.cpus_per_worker:
            wanted["CPU"] = self.cpus_per_worker
        return wanted

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: one per node, its ranks' resources summed."""
        return [
            {name: amount * self.workers_per_node for name, amount in self.per_worker().items()}
            for _ in range(self.nodes)
        ]

    def bundle_of(self, rank: int) -> int:
        return rank // self.workers_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.workers_per_node

    def shortfall(self, nodes: Mapping[str, Mapping[str, float]]) -> str | None:
        """Why no cluster of ``nodes`` (each node's total resources) can hold the job's
        bundles; None when it can (this checks totals, not what other jobs hold)."""
        bundle = self.bundles()[0]
        fits = [
            node
            for node, has in nodes.items()
            if all(has.get(name, 0.0) >= amount for name, amount in bundle.items())
        ]
        whole = {name: amount * self.nodes for name, amount in bundle.items()}
        summed = {name: sum(has.get(name, 0.0) for has in nodes.values()) for name in whole}
        short = [f"{n} {summed[n]:g} of {whole[n]:g}" for n in whole if summed[n] < whole[n]]
        if short:
            return f"the cluster has {', '.join(short)} the job needs"
        if not fits:
            return (
                f"no node holds one bundle of {_spelled(bundle)} "
                f"({self.workers_per_node} ranks of {_spelled(self.per_worker())})"
            )
        if self.strategy == "STRICT_PACK" and not any(
            all(has.get(name, 0.0) >= amount for name, amount in whole.items())
            for has in nodes.values()
        ):
            return (
                f"STRICT_PACK puts all {self.nodes} bundles on one node; "
                f"none holds {_spelled(whole)}"
            )
        if self.strategy == "STRICT_SPREAD" and len(fits) < self.nodes:
            return (
                f"STRICT_SPREAD puts each of {self.nodes} bundles on its own node; "
                f"{len(fits)} node(s) hold one of {_spelled(bundle)}"
            )
        return None


def _spelled(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items())) or "none"


def rank_env(
    layout: RankLayout,
    rank: int,
    *,
    job: Mapping[str, str],
    ray_node: str,
    host: str,
) -> dict[str, str]:
    """Rank ``rank``'s variables on Ray node ``ray_node`` at ``host``: ``job``'s (the
    coordinator's address, run id, recovery), torchrun's, and where it listens. A
    replacement is told generation 0: it joins whichever generation forms next."""
    bundle = layout.bundle_of(rank)
    return {
        **job,
        "RANK": str(rank),
        "LOCAL_RANK": str(layout.local_rank(rank)),
        "GROUP_RANK": str(bundle),
        "WORLD_SIZE": str(layout.num_workers),
        "LOCAL_WORLD_SIZE": str(layout.workers_per_node),
        "SHARDWIRE_NODE_ID": f"ray-{ray_node[:12]}-{bundle}",
        "SHARDWIRE_GENERATION": "0",
        "SHARDWIRE_BIND_HOST": host,
        "SHARDWIRE_ADVERTISE_HOST": host,
        "PYTHONUNBUFFERED": "1",
    }
