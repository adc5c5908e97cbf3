"""What a scheduler's environment tells shardwire (Slurm, Kubernetes, Kubeflow), the
job's derived token, and token files: pure functions over environments and files."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from shardwire.protocol import ShardwireError
from shardwire.protocol.auth import load_token, read_token_file
from shardwire.worker.launcher.cluster import (
    NodePlace,
    SchedulerError,
    node_place,
    rank_place,
)
from shardwire.worker.launcher.direct import placed
from shardwire.worker.launcher.options import LaunchSettings, with_scheduler
from shardwire.worker.launcher.secret import job_token, secret_path
from shardwire.worker.runtime.worker_config import WorkerConfig


def slurm(node: str, **more: str) -> dict[str, str]:
    """One task per node on three nodes, as srun sets it (job 4321, step 0)."""
    return {
        "SLURM_JOB_ID": "4321",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
        "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
        "SLURMD_NODENAME": node,
        **more,
    }


def test_slurm_one_task_per_node_reads_the_node_list_in_slurms_order() -> None:
    place = node_place(slurm("cpu1"))
    assert place == NodePlace(
        "slurm",
        node_rank=2,
        nnodes=3,
        coordinator=("gpu07", 20000 + 4321),
        run_id="slurm-4321.0",
        node_id="cpu1",
        job_id="4321",
    )
    assert node_place(slurm("gpu07")).node_rank == 0


def test_slurm_port_wraps_inside_its_span() -> None:
    place = node_place(slurm("gpu08", SLURM_JOB_ID="1234567"))
    assert place.coordinator == ("gpu07", 20000 + 4567)


def test_slurm_worker_with_several_tasks_per_node_is_refused() -> None:
    env = slurm("gpu07", SLURM_STEP_TASKS_PER_NODE="2(x3)")
    with pytest.raises(SchedulerError, match=r"ntasks-per-node=1.*shardwire run"):
        node_place(env)


def test_slurm_node_missing_from_the_list_is_refused() -> None:
    with pytest.raises(SchedulerError, match="not in the step's node list"):
        node_place(slurm("elsewhere"))


def test_slurm_batch_script_without_a_step_is_not_a_place() -> None:
    env = slurm("gpu07")
    del env["SLURM_STEP_ID"]
    assert node_place(env) is None


def ranks(node: str, procid: int, localid: int, per_node: str = "2(x2)") -> dict[str, str]:
    return {
        **slurm(node),
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
    }


def test_slurm_one_task_per_rank() -> None:
    place = rank_place(ranks("n2", 3, 1))
    assert (place.rank, place.world_size, place.local_rank, place.local_world_size) == (3, 4, 1, 2)
    assert (place.node_rank, place.node_id, place.coordinator) == (1, "n2", ("n1", 24321))
    assert place.run_id == "slurm-4321.0"


def test_slurm_cyclic_distribution_is_refused_with_the_fix() -> None:
    with pytest.raises(SchedulerError, match="are 1, not 2, 3.*--distribution=block"):
        rank_place(ranks("n2", 1, 0))  # cyclic: task 1 is the second node's first
    # task 0 is in its block place, but its node holds tasks 0 and 2: refused as well
    with pytest.raises(SchedulerError, match="are 0, 2, not 0, 1"):
        rank_place({**ranks("n1", 0, 0), "SLURM_GTIDS": "0,2"})
    assert rank_place({**ranks("n1", 0, 0), "SLURM_GTIDS": "0,1"}).rank == 0


def test_slurm_uneven_tasks_per_node_are_refused() -> None:
    with pytest.raises(SchedulerError, match="same number of tasks on every node"):
        rank_place(ranks("n1", 0, 0, per_node="3,1"))


def test_run_outside_a_scheduler_says_what_to_use() -> None:
    with pytest.raises(SchedulerError, match="under srun"):
        rank_place({"RANK": "0"})


def test_kubernetes_indexed_job_gives_the_node_rank_only() -> None:
    assert node_place({"JOB_COMPLETION_INDEX": "3"}) == NodePlace("kubernetes", node_rank=3)
    with pytest.raises(SchedulerError, match="JOB_COMPLETION_INDEX"):
        node_place({"JOB_COMPLETION_INDEX": "x"})


def test_kubeflow_trainer_variables() -> None:
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29500",
    }
    assert node_place(env) == NodePlace(
        "kubeflow",
        node_rank=1,
        nnodes=2,
        nproc_per_node=4,
        coordinator=("job-node-0-0.job", 29500),
    )
    auto = node_place({**env, "PET_NPROC_PER_NODE": "auto", "PET_NNODES": "1:2"})
    assert auto.nproc_per_node is None and auto.nnodes is None


@pytest.fixture()
def home(tmp_path: Path) -> dict[str, str]:
    return {"HOME": str(tmp_path)}


def test_the_scheduler_fills_what_the_user_did_not_say(home) -> None:
    settings, serve = with_scheduler(LaunchSettings(), node_place(slurm("gpu07")), home)
    assert serve is True  # this node (rank 0 of the step) runs the coordinator
    assert (settings.coordinator, settings.nnodes, settings.node_rank) == ("gpu07:24321", "3", 0)
    assert (settings.run_id, settings.node_id) == ("slurm-4321.0", "gpu07")
    assert settings.token is not None and len(settings.token.get_secret_value()) == 64
    other, serve = with_scheduler(LaunchSettings(), node_place(slurm("cpu1")), home)
    assert not serve and other.token == settings.token


def test_flags_win_over_the_scheduler(home) -> None:
    given = LaunchSettings(
        coordinator="10.0.0.5:29400", run_id="mine", node_rank=5, nnodes="1:3", token="t"
    )
    settings, serve = with_scheduler(given, node_place(slurm("gpu07")), home)
    assert not serve  # a coordinator of the user's: nobody starts one
    assert (settings.coordinator, settings.run_id, settings.node_rank) == (
        "10.0.0.5:29400",
        "mine",
        5,
    )
    assert settings.nnodes == "1:3" and settings.token.get_secret_value() == "t"
    port = LaunchSettings(coordinator_port=31000)
    moved, _ = with_scheduler(port, node_place(slurm("gpu08")), home)
    assert moved.coordinator == "gpu07:31000"


def test_standalone_ignores_the_scheduler(home) -> None:
    settings, serve = with_scheduler(
        LaunchSettings(standalone=True), node_place(slurm("gpu07")), home
    )
    assert not serve and settings.run_id == "shardwire"


def test_rank_zero_serves_in_one_task_per_rank(home) -> None:
    for procid, local, node, serves in ((0, 0, "n1", True), (1, 1, "n1", False)):
        place = rank_place(ranks(node, procid, local))
        settings, serve = placed(LaunchSettings(), place, home)
        assert serve is serves
        assert (settings.nproc_per_node, settings.nnodes, settings.node_rank) == (2, "2", 0)
        assert settings.coordinator == "n1:24321"


def test_each_job_has_its_own_token_from_one_private_secret(home) -> None:
    a, b = job_token("slurm", "1", home), job_token("slurm", "2", home)
    assert a != b and a == job_token("slurm", "1", home)
    path = secret_path(home)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert a != job_token("slurm", "1", {"HOME": str(path.parent / "other")})


def test_a_secret_others_can_read_is_refused(home) -> None:
    job_token("slurm", "1", home)
    secret_path(home).chmod(0o644)
    with pytest.raises(ShardwireError, match="mode 0600"):
        job_token("slurm", "1", home)


def test_tasks_starting_together_agree_on_one_secret(home) -> None:
    tokens: list[str] = []
    threads = [
        threading.Thread(target=lambda: tokens.append(job_token("slurm", "9", home)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(tokens) == 8 and len(set(tokens)) == 1
    assert sorted(p.name for p in secret_path(home).parent.iterdir()) == ["secret"]


def test_token_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\nignored\n")
    path.chmod(0o600)
    assert read_token_file(str(path)) == "s3cret"
    assert load_token(None, str(path)).present
    for mode in (0o644, 0o620, 0o602):
        path.chmod(mode)
        with pytest.raises(ShardwireError, match=f"mode {mode:04o}.*chmod 600"):
            read_token_file(str(path))
    path.chmod(0o640)  # a group may read (a mounted secret's group), never write
    assert read_token_file(str(path)) == "s3cret"
    path.write_text("\n")
    path.chmod(0o600)
    with pytest.raises(ShardwireError, match="is empty"):
        read_token_file(str(path))
    with pytest.raises(ShardwireError, match="cannot read"):
        read_token_file(str(tmp_path / "absent"))


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner needs root to make")
def test_a_token_file_of_another_owner_is_taken_as_mounted(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("mounted\n")
    path.chmod(0o644)
    os.chown(path, 12345, 12345)
    assert read_token_file(str(path)) == "mounted"


def test_a_kubernetes_service_link_in_a_port_setting_is_named(monkeypatch) -> None:
    from pydantic import ValidationError

    from shardwire.coordinator.settings import CoordinatorSettings

    link = "tcp://10.96.0.7:29400"
    monkeypatch.setenv("SHARDWIRE_COORDINATOR_PORT", link)
    with pytest.raises(ValidationError, match="Kubernetes service link.*enableServiceLinks"):
        LaunchSettings()
    monkeypatch.setenv("SHARDWIRE_PORT", link)
    with pytest.raises(ValidationError, match="SHARDWIRE_PORT=.*service link"):
        CoordinatorSettings()
    monkeypatch.setenv("SHARDWIRE_PORT", "29500")
    assert CoordinatorSettings().port == 29500


def test_trace_reaches_the_workers_environment(tmp_path, monkeypatch) -> None:
    from shardwire.worker.launcher.agent import worker_env

    monkeypatch.chdir(tmp_path)
    address = ("127.0.0.1", 29400)
    off = worker_env(LaunchSettings(run_id="r1"), address, {})
    assert "SHARDWIRE_TRACE" not in off
    default = worker_env(LaunchSettings(run_id="r1", trace=True), address, {})
    assert default["SHARDWIRE_TRACE"] == "1"
    assert default["SHARDWIRE_TRACE_DIR"] == str(tmp_path / "traces" / "r1")
    chosen = worker_env(LaunchSettings(trace=True, trace_dir="t"), address, {})
    assert chosen["SHARDWIRE_TRACE_DIR"] == str(tmp_path / "t")
    # the worker reads the same two variables
    launched = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1"}
    assert WorkerConfig.from_env({**launched, **chosen}).trace == str(tmp_path / "t")
    assert WorkerConfig.from_env(
        {**launched, "SHARDWIRE_RUN_ID": "r2", "SHARDWIRE_TRACE": "1"}
    ).trace == str(Path("traces") / "r2")
    assert WorkerConfig.from_env({**launched, "SHARDWIRE_TRACE_DIR": "d"}).trace is None


def test_a_directory_in_shardwire_trace_is_refused_naming_the_new_variable(monkeypatch) -> None:
    launched = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "1", "SHARDWIRE_TRACE": "/tmp/t"}
    with pytest.raises(ValidationError, match="a directory goes in SHARDWIRE_TRACE_DIR"):
        WorkerConfig.from_env(launched)
    monkeypatch.setenv("SHARDWIRE_TRACE", "/tmp/t")
    with pytest.raises(ValidationError, match="a directory goes in SHARDWIRE_TRACE_DIR"):
        LaunchSettings()
    monkeypatch.setenv("SHARDWIRE_TRACE", "yes")
    assert LaunchSettings().trace is True
