"""Commands of the slow-links guide run as written: charlm trained with streaming DiLoCo
and int8 outer syncs, and the measuring module run as a job of two hosts' workers (here
two node agents on loopback, each with its own node id, as two hosts have)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from .cli import env, start_coordinator
from .pageruns import page_argv, run_page_command

pytestmark = pytest.mark.e2e


@pytest.mark.long(35)
def test_the_guide_s_streaming_diloco_command_trains_charlm(tmp_path) -> None:
    done = run_page_command("charlm-diloco", tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("[rank0]: steps   ") :]
    assert re.search(r"^\[rank0\]: steps +100$", summary, re.M), summary
    assert re.search(r"'fragments': 4, 'overlap': True, 'quantize': 'int8'", summary), summary
    sent = re.search(r"^\[rank0\]: outer_largest_exchange_bytes +(\d+)$", summary, re.M)
    assert sent and int(sent.group(1)) > 0, summary


def test_the_measuring_module_runs_as_a_job_of_two_hosts(tmp_path) -> None:
    token = {"SHARDWIRE_TOKEN": "measure-token"}
    coordinator, port = start_coordinator("--world-size", "2", "--http-port", "-1", **token)
    argv = page_argv("measure-real-hosts", {"--coordinator": f"127.0.0.1:{port}"})
    workers = []
    try:
        for host in ("host-a", "host-b"):
            workers.append(
                subprocess.Popen(
                    argv,
                    cwd=tmp_path,
                    env=env(SHARDWIRE_NODE_ID=host, **token),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [w.communicate(timeout=240)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-2000:] for o in outs)
        assert coordinator.wait(timeout=60) == 0
    finally:
        for proc in (*workers, coordinator):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = json.loads((tmp_path / "cells.json").read_text())
    assert {(r["op"], r["bytes"]) for r in records} == {("all_reduce", 16 << 20)}, records
