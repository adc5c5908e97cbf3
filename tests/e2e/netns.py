"""Hosts for real on one machine: Linux network namespaces joined by a bridge, each with
a private address (10.77.0.N by default). The ``hosts`` fixture (in conftest) makes and
removes them; tests skip with the reason where namespaces cannot be made. Other helpers
(the Slurm cluster) pass their own ``subnet`` and ``prefix`` so their namespaces never
share a name or an address with these."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from .cli import ROOT, SHARDWIRE

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def make_hosts(count: int, *, subnet: str = SUBNET, prefix: str = "sw"):
    """Yield the names of ``count`` namespaces with addresses ``{subnet}.1`` onwards.

    ``prefix`` (two letters) starts every namespace and interface name, so helpers with
    different prefixes can hold namespaces at the same time.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"{os.getpid() % 100000}"
    hub, names = f"{prefix}hub{tag}", [f"{prefix}h{i}x{tag}" for i in range(count)]
    try:
        _ip("netns", "add", hub)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    made = [hub]
    try:
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            _ip("netns", "add", name)
            made.append(name)
            inner, outer = f"{prefix}{i}i{tag}"[:15], f"{prefix}{i}o{tag}"[:15]
            _ip(
                "link",
                "add",
                inner,
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                outer,
                "netns",
                hub,
            )
            _ip("-n", hub, "link", "set", outer, "master", "br0")
            _ip("-n", hub, "link", "set", outer, "up")
            _ip("-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in made:
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=10
            )


def inside(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def coordinator_inside(
    ns: str, host: str, port: int, *, world_size: int, run_id: str, env: dict[str, str]
) -> subprocess.Popen:
    """A coordinator of ``world_size`` workers listening on ``host:port`` in ``ns`` (no
    status page)."""
    return inside(
        ns,
        SHARDWIRE,
        "coordinator",
        "--host",
        host,
        "--port",
        str(port),
        "--world-size",
        str(world_size),
        "--run-id",
        run_id,
        "--http-port",
        "-1",
        env=env,
    )


def worker_inside(
    ns: str,
    coordinator: str,
    *script: str,
    nnodes: int,
    nproc: int,
    node_id: str,
    node_rank: int,
    run_id: str,
    env: dict[str, str],
) -> subprocess.Popen:
    """``shardwire worker`` in ``ns``: node ``node_rank`` of ``nnodes`` with ``nproc``
    ranks running ``script`` (a path and its arguments)."""
    return inside(
        ns,
        SHARDWIRE,
        "worker",
        "--coordinator",
        coordinator,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--node-id",
        node_id,
        "--node-rank",
        str(node_rank),
        "--run-id",
        run_id,
        *script,
        env=env,
    )
