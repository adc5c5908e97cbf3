"""Several hosts behind firewalls that admit only the ports a job declares: the
coordinator's port on its host, ``--peer-port-range`` on the workers' hosts. Three
network namespaces on a bridge, each with an nftables input chain that drops every other
new connection (as a default-deny host firewall does); skipped where namespaces or nft
are not available."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.docblocks import block

from .cli import ROOT, SCRIPTS, SHARDWIRE, env
from .netns import SUBNET, inside
from .pageruns import page_argv

pytestmark = pytest.mark.e2e

COORDINATOR_PORT = 29400
SETTINGS = {"SHARDWIRE_CONNECT_TIMEOUT": "8"}


def guide_token(directory: Path) -> Path:
    """A token file made in ``directory`` by the running guide's own command (the
    first; the second copies it to the other hosts, which here share the directory)."""
    make, copy = block("running-token").commands()
    assert copy.startswith("scp -p token WORKER_HOST:")
    subprocess.run(["sh", "-c", make], cwd=directory, check=True, timeout=60)
    return directory / "token"


def _guide(label: str, coordinator: str) -> list[str]:
    """The running guide's command ``label`` as a user types it on a host whose
    coordinator is at ``coordinator`` (in the place of the page's COORDINATOR_HOST)."""
    if label == "running-coordinator":
        return page_argv(label, {})
    return page_argv(label, {"--coordinator": f"{coordinator}:{COORDINATOR_PORT}"})


def _admitted() -> tuple[int, int]:
    """The peer ports the guide's worker command pins (what its firewall must open)."""
    low, high = re.search(r"--peer-port-range (\d+)-(\d+)", block("running-worker").text).groups()
    return int(low), int(high)


def _firewall(ns: str, ports: str) -> None:
    """Drop every new inbound TCP connection to ``ns`` but those to ``ports``."""
    rules = f"""
table inet shardwire_test {{
  chain input {{
    type filter hook input priority 0; policy drop;
    iif lo accept
    ct state established,related accept
    tcp dport {{ {ports} }} accept
  }}
}}
"""
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
        timeout=10,
    )


@pytest.fixture
def firewalled(hosts, tmp_path):
    """The hosts behind their firewalls, and the token file the guide's command made."""
    if shutil.which("nft") is None:
        pytest.skip("nftables' nft is not installed")
    coordinator_ns, *nodes = hosts
    _firewall(coordinator_ns, str(COORDINATOR_PORT))
    low, high = _admitted()
    for ns in nodes:
        _firewall(ns, f"{low}-{high}")
    return hosts, guide_token(tmp_path)


def _job(firewalled, ranges: tuple[str, str]) -> tuple[list[int], str, float]:
    """A coordinator and two worker hosts of two ranks each, node ``i`` listening on
    ``ranges[i]``, started as the running guide starts them; returns the workers' exit
    codes, their output and the time taken."""
    (coordinator_ns, *nodes), token = firewalled
    address = f"{SUBNET}.1:{COORDINATOR_PORT}"
    serve = ["--host", "0.0.0.0", "--port", str(COORDINATOR_PORT), "--world-size", "4"]
    job = ["--run-id", "fw", "--token-file", str(token)]
    coordinator = inside(
        coordinator_ns, SHARDWIRE, "coordinator", *serve, *job, env=env(**SETTINGS)
    )
    procs = [coordinator]
    start = time.monotonic()
    try:
        for index, (ns, ports) in enumerate(zip(nodes, ranges, strict=True)):
            node = ["--nnodes", "2", "--nproc-per-node", "2", "--node-id", f"node-{index}"]
            node += ["--node-rank", str(index), "--peer-port-range", ports]
            script = str(SCRIPTS / "listening.py")
            worker = [SHARDWIRE, "worker", "--coordinator", address, *node, *job, script]
            procs.append(inside(ns, *worker, env=env(**SETTINGS)))
        outputs = [p.communicate(timeout=240) for p in procs[1:]]
        took = time.monotonic() - start
        return [p.returncode for p in procs[1:]], "".join(o + e for o, e in outputs), took
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _host(ns: str, name: str, argv: list[str], cwd: Path) -> subprocess.Popen:
    """``argv`` run in ``ns`` as on a machine called ``name`` (its own host name, as a
    node's default id is), in ``cwd``."""
    named = ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh", *argv]
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *named],
        cwd=cwd,
        env=env(**SETTINGS),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_running_guide_trains_across_firewalled_hosts_as_written(firewalled) -> None:
    """The guide's commands, copied as written (its coordinator host's address put in),
    train digits on two worker hosts whose firewalls admit only the guide's ports, and
    its status command shows the job from a worker host."""
    (coordinator_ns, *nodes), token = firewalled
    here = token.parent  # the token, and examples/ as in a checkout
    (here / "examples").symlink_to(ROOT / "examples")
    address = f"{SUBNET}.1"
    procs = [
        _host(coordinator_ns, "coordinator-host", _guide("running-coordinator", address), here)
    ]
    try:
        for i, ns in enumerate(nodes):
            procs.append(_host(ns, f"worker-host-{i}", _guide("running-worker", address), here))
        status, deadline = None, time.monotonic() + 240
        while time.monotonic() < deadline:  # until the job is formed and training
            look = _host(nodes[0], "worker-host-0", _guide("running-status", address), here)
            status = look.communicate(timeout=60)[0]
            if status.count(" running ") >= 8 or any(p.poll() is not None for p in procs):
                break
            time.sleep(1)
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
        assert status is not None and status.count(" running ") >= 8, status
        # (a rank listening anywhere else could not have been reached through the firewall)
        assert "held_out_accuracy" in outputs[1] + outputs[2]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_listeners_outside_the_admitted_ports_fail_fast_naming_the_port(firewalled) -> None:
    # both nodes' ranks listen where their firewalls drop: no connection between the
    # hosts can be made in either direction
    codes, out, took = _job(firewalled, ("29600-29601", "29600-29601"))
    assert codes[0] != 0 and codes[1] != 0, out[-3000:]
    # the address and the port in the error, within the connect timeout (8 s) and the
    # verdict's wait
    dropped = rf"{SUBNET}\.[23]:2960[01] within 8 s \(no attempt finished: does a firewall"
    root = rf"root cause \(from the coordinator\): .*{dropped}"
    assert re.search(root, out), out[-3000:]
    assert took < 120, took
