"""shardwire jobs on a real Ray cluster (three nodes on this machine): the ranks as
actors end with the loss ``shardwire launch`` gives, bit for bit; a rank's process
killed, or a node removed, is started again by Ray and joins live while the other
ranks keep their processes; and what cannot run is refused with a typed error."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docblocks import block
from tests.e2e.cli import ROOT, SHARDWIRE, env, run_records

from .conftest import LOOPBACK, LocalCluster

pytestmark = pytest.mark.e2e
DIGITS = ["examples/digits.py", "--steps", "400", "--log-every", "10"]
# Long enough for one job's ranks to start and train; bounded for a loaded machine.
JOB_TIMEOUT = 300


def _ray(cluster: LocalCluster, *flags: str, script: list[str], run: Path) -> list[str]:
    """``shardwire ray`` of ``script`` into run directory ``run`` on ``cluster``."""
    return [
        SHARDWIRE,
        "ray",
        "--address",
        cluster.address,
        *flags,
        *script,
        "--run-dir",
        str(run),
    ]


def _job(command: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=ROOT,
        env=env(**LOOPBACK, **extra),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[dict, dict]:
    """digits under ``shardwire launch``: what every run on Ray must equal."""
    run = tmp_path_factory.mktemp("launched") / "run"
    command = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "4", *DIGITS]
    done = _job([*command, "--run-dir", str(run)])
    assert done.returncode == 0, done.stderr[-3000:]
    return run_records(run)


def _same(run: Path, launched: tuple[dict, dict]) -> None:
    records, summary = run_records(run)
    assert records == launched[0]  # every logged loss, rate and accuracy
    for key in ("final_loss", "held_out_accuracy"):
        assert summary[key] == launched[1][key]


def _places(stderr: str) -> dict[int, list[tuple[int, str]]]:
    """Each rank's processes, in order, and the node each ran on (the driver's lines)."""
    out: dict[int, list[tuple[int, str]]] = {}
    for rank, pid, node in re.findall(
        r"\[ray\]: rank (\d+): (?:back as )?process (\d+) on node (\w+)", stderr
    ):
        out.setdefault(int(rank), []).append((int(pid), node))
    return out


def _printed_by(stdout: str, rank: int) -> set[int]:
    """The processes a rank's lines came from (Ray prefixes each with them)."""
    return {int(p) for p in re.findall(rf"\(rank{rank} pid=(\d+)\)", stdout)}


def test_digits_on_ray_ends_as_under_launch_bit_for_bit(
    ray_cluster: LocalCluster, launched, tmp_path
) -> None:
    """One node of four ranks, as ``launch --nproc-per-node 4`` lays them out."""
    flags = ["--num-workers", "4", "--workers-per-node", "4", "--cpus-per-worker", "0.5"]
    done = _job(_ray(ray_cluster, *flags, script=DIGITS, run=tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path, launched)
    places = _places(done.stderr)
    assert sorted(places) == [0, 1, 2, 3]
    assert len({places[r][0][1] for r in range(4)}) == 1  # one bundle, one host
    assert "step 400/400" in done.stdout and "(rank0 pid=" in done.stdout
    assert "4 ranks on 1 node(s), 0 rank(s) started again" in done.stderr


SPREAD = ["--num-workers", "4", "--workers-per-node", "2"]


@pytest.fixture(scope="module")
def spread(ray_cluster: LocalCluster, tmp_path_factory) -> tuple[dict, dict]:
    """digits on two nodes of two ranks, with no fault: what the faulty runs equal."""
    run = tmp_path_factory.mktemp("spread") / "run"
    done = _job(_ray(ray_cluster, *SPREAD, script=DIGITS, run=run))
    assert done.returncode == 0, done.stderr[-3000:]
    # a node's two ranks share a Ray node; the two nodes differ
    places = _places(done.stderr)
    nodes = [places[r][0][1] for r in range(4)]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    return run_records(run)


KILLS = """
seed = 1
[[faults]]
kind = "kill"
rank = 1
step = 100
[[faults]]
kind = "kill"
rank = 2
step = 200
"""


@pytest.mark.long(75)
def test_killed_ranks_are_started_again_by_ray_and_join_live(
    ray_cluster: LocalCluster, spread, tmp_path
) -> None:
    plan = tmp_path / "kills.toml"
    plan.write_text(KILLS)
    command = _ray(
        ray_cluster,
        *SPREAD,
        "--max-restarts",
        "2",
        "--chaos",
        str(plan),
        script=[*DIGITS, "--copy-every", "5"],
        run=tmp_path / "run",
    )
    done = _job(command, SHARDWIRE_CHAOS_LOG=str(tmp_path / "chaos.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path / "run", spread)  # rolled back to the peers' copies, bit for bit
    places = _places(done.stderr)
    # ranks 1 and 2 each in a second process, on the same node; 0 and 3 in their first
    assert {r: len(p) for r, p in places.items()} == {0: 1, 1: 2, 2: 2, 3: 1}
    assert places[1][0][1] == places[1][1][1] and places[1][0][0] != places[1][1][0]
    for survivor in (0, 3):
        assert _printed_by(done.stdout, survivor) <= {places[survivor][0][0]}
    assert _printed_by(done.stdout, 0) == {places[0][0][0]}
    # the newest copies whole before each kill (the killed rank never sent the last)
    assert "resuming" in done.stdout and "at step 95 " in done.stdout
    assert "at step 195 " in done.stdout
    assert "2 rank(s) started again" in done.stderr


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, bound: float) -> None:
    deadline = time.monotonic() + bound
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.1)
    pytest.fail(f"the job never logged step {step} (exit {proc.poll()})")


@pytest.mark.long(40)
def test_a_removed_node_s_ranks_start_again_on_a_new_node_and_the_rest_go_on(
    ray_cluster: LocalCluster, spread, tmp_path
) -> None:
    command = _ray(
        ray_cluster,
        *SPREAD,
        "--max-restarts",
        "3",
        script=[*DIGITS, "--copy-every", "5"],
        run=tmp_path / "run",
    )
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env(**LOOPBACK), stdout=stdout, stderr=stderr, text=True
        )
        try:
            _wait_for_step(tmp_path / "run", 100, proc, JOB_TIMEOUT / 2)
            placed = _places(err.read_text())
            lost = next(n for n in ray_cluster.nodes if n.node_id.startswith(placed[2][0][1]))
            ray_cluster.remove(lost)
            ray_cluster.add()  # where Ray places the lost bundle
            proc.wait(JOB_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err.read_text()[-3000:]
    _same(tmp_path / "run", spread)
    places = _places(err.read_text())
    moved = {places[r][-1][1] for r in (2, 3)}
    assert len(moved) == 1 and moved != {placed[2][0][1]}  # both on the new node
    assert {r: len(p) for r, p in places.items() if r in (0, 1)} == {0: 1, 1: 1}
    assert _printed_by(out.read_text(), 0) == {placed[0][0][0]}  # rank 0 kept its process


def test_too_few_cpus_for_the_ranks_is_refused_typed(ray_cluster: LocalCluster, tmp_path) -> None:
    command = _ray(
        ray_cluster, "--num-workers", "8", "--workers-per-node", "2", script=DIGITS, run=tmp_path
    )
    done = _job(command)
    assert done.returncode == 1
    assert "8 ranks, 2 per node, cannot be placed: the cluster has CPU 4 of 8" in done.stderr


def test_a_strategy_the_cluster_cannot_meet_is_refused_typed(
    ray_cluster: LocalCluster, tmp_path
) -> None:
    flags = [*SPREAD, "--strategy", "STRICT_PACK"]
    done = _job(_ray(ray_cluster, *flags, script=DIGITS, run=tmp_path))
    assert done.returncode == 1
    assert "STRICT_PACK puts all 2 bundles on one node; none holds 4 CPU" in done.stderr


def test_a_script_the_nodes_cannot_see_is_refused_naming_the_rank(
    ray_cluster: LocalCluster, tmp_path
) -> None:
    missing = str(tmp_path / "nowhere" / "train.py")
    done = _job(_ray(ray_cluster, "--num-workers", "2", script=[missing], run=tmp_path))
    assert done.returncode == 1
    said = r"rank \d failed: ScriptNotFound: rank \d on Ray node \w+ finds no script"
    assert re.search(said, done.stderr)


def test_a_cluster_that_does_not_answer_is_refused_at_once(tmp_path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed (make ray)")
    start = time.monotonic()
    done = _job([SHARDWIRE, "ray", "--address", "127.0.0.1:9", "--num-workers", "2", *DIGITS])
    assert done.returncode == 1
    assert "no Ray cluster answers at 127.0.0.1:9" in done.stderr
    assert time.monotonic() - start < JOB_TIMEOUT  # not Ray's own minutes-long wait


@pytest.mark.long(30)
def test_the_clusters_page_command_runs_as_written(ray_cluster: LocalCluster, tmp_path) -> None:
    (command,) = block("ray-run").commands()
    argv = shlex.split(command)
    assert argv[:2] == ["shardwire", "ray"]
    argv[argv.index("--address") + 1] = ray_cluster.address  # the page's head node
    done = _job([SHARDWIRE, *argv[1:], "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.stderr[-3000:]
    said = "\n".join(line for line in done.stderr.splitlines() if "rank" in line)
    assert "4 ranks on 2 node(s), 0 rank(s) started again" in done.stderr, said[-6000:]
    assert "step 200/200" in done.stdout


def _driver(cluster: LocalCluster, case: str, *, niceness: int = 0) -> dict:
    done = _job(
        [
            "nice",
            "-n",
            str(niceness),
            sys.executable,
            str(Path(__file__).parent / "scripts" / "driver.py"),
            cluster.address,
            case,
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_function_runs_on_every_rank_and_rank_0_s_result_comes_back(
    ray_cluster: LocalCluster,
) -> None:
    out = _driver(ray_cluster, "function", niceness=3)["result"]
    assert out["sum"] == 2.0 * (0 + 1 + 2 + 3) and out["rank"] == 0
    # the driver's, on every thread of the rank's process: not Ray's 15
    assert out["niceness"] == [min(os.nice(0) + 3, 19)]
    assert out["run_id"] == "fn-job"
    assert out["node"].startswith("ray-") and out["node"].endswith("-0")


def test_custom_resources_are_asked_per_rank(ray_cluster: LocalCluster) -> None:
    out = _driver(ray_cluster, "too-much-of-a-resource")
    assert out["error"] == "PlacementUnavailable"
    assert "the cluster has trainer 4 of 8 the job needs" in out["message"]


def test_a_placement_held_by_other_work_gives_up_after_the_placement_timeout(
    ray_cluster: LocalCluster,
) -> None:
    out = _driver(ray_cluster, "held-elsewhere")
    assert out["error"] == "PlacementUnavailable"
    assert "within 3 s (other work holds the resources?)" in out["message"]
