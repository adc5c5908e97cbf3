"""shardwire on a real Slurm cluster of two nodes (the ``slurm`` fixture: Debian's
slurmctld, two slurmd and munged in network namespaces): both shapes of a job step work
with no flags beyond the script, and the example batch file runs as shipped with only
its training line changed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.docblocks import block

from .cli import ROOT, SCRIPTS, SHARDWIRE

pytestmark = pytest.mark.e2e

WHOAMI = str(SCRIPTS / "whoami.py")


def _private_secret(tmp_path: Path) -> dict[str, str]:
    """The derived token's secret in the test's directory (the nodes share it, as a
    cluster's home directory is shared), not the user's own."""
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def _ranks(out: str) -> list[str]:
    """Every rank's own line, without the agent's prefix, by rank."""
    lines = [line.split("]: ", 1)[-1] for line in out.splitlines() if line.endswith(" ok")]
    return sorted(lines, key=lambda line: int(line.split()[1]))


def _page_step(label: str, script: str) -> list[str]:
    """The clusters page's ``srun`` command ``label`` with its placeholder script
    (``train.py`` and its arguments) replaced by ``script``, and two nodes: the page's
    command runs inside an allocation of two, which this cluster's ``srun`` is given."""
    (command,) = block(label).commands()
    argv = shlex.split(command)
    at = argv.index("train.py")
    assert argv[0] == "srun" and argv[argv.index("shardwire") + 1] in ("worker", "run")
    argv[argv.index("shardwire")] = SHARDWIRE
    return ["srun", "-N2", *argv[1:at], script]


def _nodes_of(ranks: int) -> list[str]:
    """What every rank of two nodes of ``ranks // 2`` ranks says, in Slurm's order."""
    local = ranks // 2
    return [
        f"rank {r} of {ranks} local {r % local} of {local} node {r // local} "
        f"id swnode{r // local + 1} ok"
        for r in range(ranks)
    ]


@pytest.mark.timeout(400)
def test_one_task_per_node_needs_only_the_script(slurm, tmp_path) -> None:
    done = slurm.run(
        *_page_step("slurm-srun-worker", WHOAMI),
        env=_private_secret(tmp_path),
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:] + slurm.log_tail()
    assert _ranks(done.stdout) == _nodes_of(8)  # the page's 4 ranks a node
    # the first node started the coordinator, at the job's port, on every address
    (port,) = re.findall(r"\[coordinator\]: listening on 0\.0\.0\.0:(\d+)", done.stderr)
    assert 20000 <= int(port) < 30000
    # the token was derived from the (shared) secret: one file, private
    secret = tmp_path / "config" / "shardwire" / "secret"
    assert secret.stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(400)
def test_one_task_per_rank_needs_only_the_script(slurm, tmp_path) -> None:
    argv = _page_step("slurm-srun-run", WHOAMI)
    assert argv[1:3] == ["-N2", "-N"]  # the page's step spans two nodes itself
    done = slurm.run(*argv[:1], *argv[2:], env=_private_secret(tmp_path), timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:] + slurm.log_tail()
    assert _ranks(done.stdout) == _nodes_of(8)


@pytest.mark.timeout(400)
def test_a_cyclic_step_is_refused_with_the_fix(slurm, tmp_path) -> None:
    done = slurm.run(
        "srun",
        "-N2",
        "--ntasks-per-node=2",
        "--distribution=cyclic",
        SHARDWIRE,
        "run",
        WHOAMI,
        env=_private_secret(tmp_path),
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode != 0
    assert "run srun with --distribution=block" in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(500)
def test_the_example_batch_file_trains_and_checkpoints(slurm, tmp_path) -> None:
    (submit,) = block("slurm-sbatch").commands()  # the file the page has a user copy
    batch = tmp_path / "train.sbatch"
    text = (ROOT / submit.removeprefix("sbatch ")).read_text()
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    train = (
        f"TRAIN=(examples/digits.py --steps 60 --save-every 30 --log-every 20 "
        f"--checkpoint-dir {ckpt} --run-dir {run_dir})"
    )
    text, changed = re.subn(r"^TRAIN=\(.*\)$", train, text, flags=re.M)
    assert changed == 1
    batch.write_text(text)
    out = tmp_path / "job.out"
    env = {**_private_secret(tmp_path), "SHARDWIRE": SHARDWIRE}
    end = slurm.sbatch_wait(batch, "--chdir", str(ROOT), "--output", str(out), env=env)
    log = out.read_text() if out.exists() else "(no output file)"
    assert (end.state, end.exit_code) == ("COMPLETED", 0), log[-3000:] + slurm.log_tail()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["steps"] == 60, summary
    verify = slurm.run(SHARDWIRE, "checkpoint", "verify", str(ckpt), cwd=ROOT)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    shutil.rmtree(ckpt)
