"""A Ray cluster on this machine's loopback, for benchmarks: a head with no CPUs and
``--nodes`` worker nodes of ``--cpus`` CPUs each, every one on 127.0.0.1.

    python -m shardwire.ray.localcluster --nodes 1 --cpus 4

prints ``address HOST:PORT`` once the nodes are up, keeps the cluster until its standard
input closes (or ``--hold`` seconds pass), then stops every process of it. Run it with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in its environment (:func:`start` sets it): Ray
then keeps every node on 127.0.0.1 instead of this host's outward address.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator

from shardwire.ray.errors import ClusterUnreachable

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DEDUP_LOGS": "0"}
_START_TIMEOUT = 120.0


@contextlib.contextmanager
def start(nodes: int, cpus: int) -> Iterator[str]:
    """A local cluster for the block's length: its head's address."""
    command = [sys.executable, "-m", "shardwire.ray.localcluster"]
    proc = subprocess.Popen(  # noqa: S603 - our own module
        [*command, "--nodes", str(nodes), "--cpus", str(cpus)],
        env={**os.environ, **LOOPBACK},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], _START_TIMEOUT)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("address "):
            raise ClusterUnreachable(f"the local Ray cluster did not start: {line or 'no word'}")
        yield line.split()[1]
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the cluster's end
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m shardwire.ray.localcluster")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--hold", type=float, default=24 * 3600.0, help="seconds at most")
    args = p.parse_args(argv)
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=args.cpus, node_ip_address="127.0.0.1")
        print(f"address {cluster.address}", flush=True)
        end = time.monotonic() + args.hold
        while time.monotonic() < end:  # until standard input closes
            ready, _, _ = select.select([sys.stdin], [], [], min(1.0, end - time.monotonic()))
            if ready and not sys.stdin.read(1):
                break
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
