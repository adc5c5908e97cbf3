"""A real etcd server for tests, from Debian's ``etcd-server`` package: one member on
loopback ports of its own and a data directory under the test's temporary directory,
stopped (by its PID) when the test is done."""

from __future__ import annotations

import contextlib
import http.client
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_START = 60.0  # seconds etcd may take to answer on a busy machine


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        pytest.skip("no etcd on this machine (CI installs Debian's etcd-server package)")
    return path


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (held together while chosen, so distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("POST", "/v3/maintenance/status", b"{}")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


@contextlib.contextmanager
def etcd_server(directory: Path, *, netns: str = "", host: str = "127.0.0.1") -> Iterator[str]:
    """A running one-member etcd cluster on ``host`` (inside network namespace ``netns``
    if given); yields its client endpoint."""
    binary = etcd_binary()
    client, peer = free_ports(2) if not netns else (2379, 2380)  # a namespace's own ports
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "etcd.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [
            *(["ip", "netns", "exec", netns] if netns else []),
            binary,
            "--name",
            "t",
            "--data-dir",
            str(directory / "data"),
            "--listen-client-urls",
            f"http://{host}:{client}",
            "--advertise-client-urls",
            f"http://{host}:{client}",
            "--listen-peer-urls",
            f"http://{host}:{peer}",
            "--initial-advertise-peer-urls",
            f"http://{host}:{peer}",
            "--initial-cluster",
            f"t=http://{host}:{peer}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + _START
        # from outside a namespace its address cannot be dialed: its log says it is ready
        while not (_ready(log_path) if netns else _answers(client)):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"etcd did not answer within {_START:g} s"
            time.sleep(0.05)
        yield f"http://{host}:{client}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _ready(log: Path) -> bool:
    return "ready to serve client requests" in log.read_text()
