"""Start order on a cluster: workers a scheduler starts before their coordinator is up, or
before its host name resolves, wait for it until the join deadline, then fail with one
clear error."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .cli import ROOT, SCRIPTS, SHARDWIRE, env

pytestmark = pytest.mark.e2e

TOKEN = {"SHARDWIRE_TOKEN": "start-order-token"}
NAME = "coordinator.shardwire.test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)


def _worker(coordinator: str, *prefix: str, join_timeout: str = "120") -> subprocess.Popen:
    return subprocess.Popen(
        [
            *prefix,
            SHARDWIRE,
            "worker",
            "--coordinator",
            coordinator,
            "--nproc-per-node",
            "2",
            "--join-timeout",
            join_timeout,
            str(SCRIPTS / "whoami.py"),
        ],
        cwd=ROOT,
        env=env(**TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _coordinator(port: int, *prefix: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*prefix, SHARDWIRE, "coordinator", "--port", str(port), "--world-size", "2"],
        cwd=ROOT,
        env=env(**TOKEN, SHARDWIRE_HTTP_PORT="-1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ok_lines(out: str) -> list[str]:
    return sorted(line.split("]: ", 1)[-1] for line in out.splitlines() if line.endswith(" ok"))


@pytest.mark.timeout(240)
def test_a_worker_started_before_its_coordinator_joins_once_it_listens() -> None:
    port = _free_port()
    worker = _worker(f"127.0.0.1:{port}")
    coordinator = None
    try:
        time.sleep(3.0)  # refused the whole time: the worker keeps trying
        assert worker.poll() is None
        coordinator = _coordinator(port)
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
        assert _ok_lines(out) == [
            "rank 0 of 2 local 0 of 2 node 0 id " + socket.gethostname() + " ok",
            "rank 1 of 2 local 1 of 2 node 0 id " + socket.gethostname() + " ok",
        ]
    finally:
        _stop(worker, *([coordinator] if coordinator else []))


@pytest.fixture()
def private_names():
    """A network namespace whose /etc/hosts and resolver the test controls (``ip netns
    exec`` mounts /etc/netns/NAME/* over /etc): no name server answers there, so a name
    resolves exactly when the test writes it into the hosts file."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    ns = f"swdns{os.getpid() % 100000}"
    etc = Path("/etc/netns") / ns
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        subprocess.run(
            ["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10
        )
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1 localhost\n")
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        yield ns, etc / "hosts"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True, timeout=10)
        shutil.rmtree(etc, ignore_errors=True)


@pytest.mark.timeout(240)
def test_a_coordinator_name_that_resolves_late_is_waited_for(private_names) -> None:
    ns, hosts = private_names
    inside = ("ip", "netns", "exec", ns)
    port = _free_port()
    early = _worker(f"{NAME}:{port}", *inside, join_timeout="4")
    try:
        _, err = early.communicate(timeout=120)
    finally:
        _stop(early)
    # never resolved: one clear error at the join deadline, naming the cause
    assert early.returncode == 1
    assert f"no coordinator answered at {NAME}:{port} within 4 s" in err, err
    assert "the name did not resolve" in err, err

    worker = _worker(f"{NAME}:{port}", *inside)
    coordinator = None
    try:
        time.sleep(3.0)
        assert worker.poll() is None
        with hosts.open("a") as fh:  # in place: the namespace's mount shows this file
            fh.write(f"127.0.0.1 {NAME}\n")
        coordinator = _coordinator(port, *inside)
        out, err = worker.communicate(timeout=180)
        assert worker.returncode == 0, err
        assert len(_ok_lines(out)) == 2, out
    finally:
        _stop(worker, *([coordinator] if coordinator else []))
