"""The ``slurm`` fixture is a real cluster: srun places tasks on both nodes with the ids
Slurm promises, and a batch job runs to COMPLETED and writes where the test can read."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_srun_places_two_tasks_on_each_of_two_nodes(slurm) -> None:
    done = slurm.run(
        "srun",
        "-N2",
        "--ntasks-per-node=2",
        "sh",
        "-c",
        'echo "$(hostname) $SLURMD_NODENAME $SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID"',
        timeout=120,
    )
    assert done.returncode == 0, f"{done.stderr}\n{slurm.log_tail()}"
    # hostname, SLURMD_NODENAME, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID per task
    tasks = sorted(tuple(line.split()) for line in done.stdout.splitlines())
    assert tasks == [
        ("swnode1", "swnode1", "0", "0", "0"),
        ("swnode1", "swnode1", "1", "1", "0"),
        ("swnode2", "swnode2", "2", "0", "1"),
        ("swnode2", "swnode2", "3", "1", "1"),
    ]


@pytest.mark.timeout(300)
def test_a_batch_job_runs_to_completed_and_writes_its_file(slurm, tmp_path) -> None:
    marker = tmp_path / "marker"
    script = tmp_path / "job.sh"
    script.write_text(f'#!/bin/sh\necho "ran on $SLURMD_NODENAME" > {marker}\n')
    end = slurm.sbatch_wait(script, "-N1", "--output", str(tmp_path / "job.out"))
    assert (end.state, end.exit_code) == ("COMPLETED", 0), slurm.log_tail()
    assert marker.read_text().strip() in {f"ran on {node}" for node in slurm.nodes}
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\nexit 3\n")
    end = slurm.sbatch_wait(failing, "--output", str(tmp_path / "fail.out"))
    assert (end.state, end.exit_code) == ("FAILED", 3)
