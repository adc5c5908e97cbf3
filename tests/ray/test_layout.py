"""Where a Ray job's ranks go and what each is told (pure: no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (make ray)")

from shardwire.protocol import InvalidArgument  # noqa: E402
from shardwire.ray.layout import RankLayout, rank_env  # noqa: E402


def test_a_node_s_ranks_share_one_bundle_of_their_summed_resources() -> None:
    layout = RankLayout(6, 3, cpus_per_worker=0.5, resources_per_worker={"trainer": 1})
    assert layout.nodes == 2
    assert layout.bundles() == [{"CPU": 1.5, "trainer": 3}] * 2
    assert [layout.bundle_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_no_cpus_asked_leaves_cpu_out_of_the_bundle() -> None:
    assert (
        RankLayout(2, cpus_per_worker=0, resources_per_worker={"gpu_box": 1}).bundles()
        == [{"gpu_box": 1}] * 2
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_workers": 0}, "1 rank or more"),
        ({"num_workers": 4, "workers_per_node": 3}, "does not divide"),
        ({"num_workers": 2, "cpus_per_worker": -1}, "0 or more"),
        ({"num_workers": 2, "strategy": "ANYWHERE"}, "not one of"),
    ],
)
def test_a_layout_that_cannot_be_is_refused_typed(kw: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        RankLayout(**kw)


NODES = {"a": {"CPU": 2.0}, "b": {"CPU": 2.0}, "head": {"CPU": 0.0}}


def test_the_shortfall_names_what_the_cluster_lacks() -> None:
    assert RankLayout(4, 2).shortfall(NODES) is None
    assert RankLayout(8, 2).shortfall(NODES) == "the cluster has CPU 4 of 8 the job needs"
    # enough CPUs in all, but no node holds a whole node's ranks
    assert "no node holds one bundle of 4 CPU" in RankLayout(4, 4).shortfall(NODES)
    spread = RankLayout(2, 1, cpus_per_worker=1, strategy="STRICT_SPREAD")
    assert spread.shortfall({"a": {"CPU": 2.0}}) == (
        "STRICT_SPREAD puts each of 2 bundles on its own node; 1 node(s) hold one of 1 CPU"
    )
    packed = RankLayout(4, 2, strategy="STRICT_PACK")
    assert packed.shortfall(NODES) == "STRICT_PACK puts all 2 bundles on one node; none holds 4 CPU"
    assert RankLayout(2, 1, strategy="STRICT_PACK").shortfall(NODES) is None
    custom = RankLayout(2, 1, resources_per_worker={"trainer": 1})
    assert custom.shortfall(NODES) == "the cluster has trainer 0 of 2 the job needs"


def test_each_rank_is_told_torchrun_s_variables_and_its_node() -> None:
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000", "SHARDWIRE_RUN_ID": "r"}
    env = rank_env(RankLayout(4, 2), 3, job=job, ray_node="abcdef0123456789", host="127.0.0.9")
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["GROUP_RANK"] == "1"
    assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["SHARDWIRE_NODE_ID"] == "ray-abcdef012345-1"
    assert env["SHARDWIRE_BIND_HOST"] == env["SHARDWIRE_ADVERTISE_HOST"] == "127.0.0.9"
    assert env["SHARDWIRE_GENERATION"] == "0"  # a replacement joins whichever forms next
    assert env["MASTER_PORT"] == "4000"
    # two bundles Ray packs onto one host are two shardwire nodes there
    other = rank_env(RankLayout(4, 2), 0, job=job, ray_node="abcdef0123456789", host="h")
    assert other["SHARDWIRE_NODE_ID"] != env["SHARDWIRE_NODE_ID"]


def test_on_ray_runs_every_rank_on_one_node_as_launch_does() -> None:
    from shardwire.ray.bench import on_ray

    command = on_ray("127.0.0.1:6379", Path("examples/charlm.py"), ["--dim=8"], 4)
    work = Path("/tmp/w")
    argv = command(work, ["--max-restarts=5"])
    assert argv[1:7] == [
        "ray",
        "--address",
        "127.0.0.1:6379",
        "--num-workers",
        "4",
        "--workers-per-node",
    ]
    assert argv[7] == "4" and "--max-restarts=5" in argv
    assert argv[argv.index("examples/charlm.py") + 1] == "--dim=8"
    assert f"--run-dir={work / 'run'}" in argv
