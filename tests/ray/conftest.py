"""A real Ray cluster on this machine for the tests of jobs on Ray: a head node with no
CPUs (the driver's) and worker nodes of 2 CPUs and 2 ``trainer`` (a custom resource)
each, every one on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Read when ray is imported: without it Ray gives every node the host's outward address,
# and a cluster pinned to 127.0.0.1 is never reached.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}
os.environ.update(LOOPBACK)

NODE_CPUS = 2


class LocalCluster:
    """Ray's ``cluster_utils.Cluster`` with worker nodes that can be removed and added."""

    def __init__(self, nodes: int) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
            },
        )
        self.nodes = [self.add() for _ in range(nodes)]

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self):
        return self.cluster.add_node(
            num_cpus=NODE_CPUS, resources={"trainer": NODE_CPUS}, node_ip_address="127.0.0.1"
        )

    def remove(self, node) -> None:
        self.cluster.remove_node(node)
        self.nodes.remove(node)

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    pytest.importorskip("ray", reason="the ray extra is not installed (make ray)")
    cluster = LocalCluster(2)
    try:
        yield cluster
    finally:
        cluster.shutdown()
