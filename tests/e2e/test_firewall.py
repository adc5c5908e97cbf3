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

from .cli import ROOT, SCRIPTS, SHARDWIRE, env, page_commands
from .netns import SUBNET, inside

pytestmark = pytest.mark.e2e

COORDINATOR_PORT = 29400
ADMITTED = (29500, 29501)
SETTINGS = {"SHARDWIRE_CONNECT_TIMEOUT": "8"}
GUIDE = ROOT / "docs" / "guide" / "running.md"


def guide_token(directory: Path) -> Path:
    """A token file made in ``directory`` by the running guide's own command."""
    (command,) = [c for c in page_commands(GUIDE.read_text()) if "umask 077" in c]
    subprocess.run(["sh", "-c", command], cwd=directory, check=True, timeout=60)
    return directory / "token"


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
        input=rules, text=True, check=True, capture_output=True, timeout=10,
    )  # fmt: skip


@pytest.fixture
def firewalled(hosts, tmp_path):
    """The hosts behind their firewalls, and the token file the guide's command made."""
    if shutil.which("nft") is None:
        pytest.skip("nftables' nft is not installed")
    coordinator_ns, *nodes = hosts
    _firewall(coordinator_ns, str(COORDINATOR_PORT))
    for ns in nodes:
        _firewall(ns, f"{ADMITTED[0]}-{ADMITTED[1]}")
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


def test_a_job_whose_listeners_use_the_admitted_ports_runs(firewalled) -> None:
    admitted = f"{ADMITTED[0]}-{ADMITTED[1]}"
    codes, out, _ = _job(firewalled, (admitted, admitted))
    assert codes == [0, 0], out[-3000:]
    ports = sorted(int(p) for p in re.findall(r"listens on (\d+)", out))
    assert ports == [29500, 29500, 29501, 29501], out[-3000:]


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
