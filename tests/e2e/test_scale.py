"""Sixty-four real ranks on this machine, as four simulated nodes of sixteen: a
coordinator and four ``shardwire worker`` agents with their own node ids. Every rank runs
every collective against numpy and exits cleanly; each reports its init time, open
descriptors, memory and the peers it connected to (printed, bounded where the bound is
the design: a rank connects only to the peers its algorithms use)."""

from __future__ import annotations

import json

import pytest

from .cli import SCRIPTS, background, start_coordinator

pytestmark = pytest.mark.e2e

NODES, PER_NODE = 4, 16
WORLD = NODES * PER_NODE


def test_sixty_four_ranks_on_four_nodes_run_every_collective(tmp_path) -> None:
    token = {"SHARDWIRE_TOKEN": "scale-token", "SHARDWIRE_IDLE_CLOSE": "2"}
    coordinator, port = start_coordinator("--world-size", str(WORLD), "--run-id", "scale", **token)
    agents = []
    try:
        agents = [
            background(
                "worker",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--nnodes",
                str(NODES),
                "--nproc-per-node",
                str(PER_NODE),
                "--node-id",
                f"node-{i}",
                "--run-id",
                "scale",
                str(SCRIPTS / "scale.py"),
                **token,
            )
            for i in range(NODES)
        ]
        outputs = [agent.communicate(timeout=600) for agent in agents]
        codes = [agent.returncode for agent in agents]
        assert codes == [0] * NODES, [err[-3000:] for _out, err in outputs]
        assert coordinator.wait(timeout=60) == 0
    finally:
        for proc in [*agents, coordinator]:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    # the launcher prefixes each line with its rank: "[rank3]: ..."
    lines = [line.split("]: ", 1)[-1] for out, _err in outputs for line in out.splitlines()]
    assert sum(line.startswith("ok ") for line in lines) == WORLD, lines[:8]
    stats = [json.loads(line[len("scale ") :]) for line in lines if line.startswith("scale ")]
    assert sorted(s["rank"] for s in stats) == list(range(WORLD))
    report = {
        "init_s_max": max(s["init_s"] for s in stats),
        "links_max": max(len(s["links"]) for s in stats),
        "fds_max": max(s["fds"] for s in stats),
        "rss_mib_max": max(s["rss_mib"] for s in stats),
        "idle_links_max": max(len(s["idle"]["links"]) for s in stats),
        "idle_fds_max": max(s["idle"]["fds"] for s in stats),
    }
    report["fd_kinds_of_max"] = max(stats, key=lambda s: s["fds"])["fd_kinds"]
    print("scale", json.dumps(report))
    (tmp_path / "scale.json").write_text(json.dumps(stats))
    # at 64 ranks every collective, all_to_all and gather_object too, pairs ranks by XOR
    # (r ^ 2^k, log2 n peers), besides a lane's neighbours across nodes; then the quiet
    # connections are closed
    assert report["links_max"] <= (WORLD - 1).bit_length() + 2, report
    assert report["fds_max"] <= 30, report
    assert report["idle_links_max"] == 0, report
    assert report["idle_fds_max"] <= 30, report
