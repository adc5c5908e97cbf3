"""The pages' commands, run as written, print what the pages show: the README's first
script (and what it does without a launcher) and the main job's output in getting
started, whose every line but the times and rates must match."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from shardwire.worker.runtime.launched import LAUNCHER_VARIABLES
from tests.docblocks import block

from .cli import ROOT, SHARDWIRE, env, run
from .pageruns import assert_shows

pytestmark = pytest.mark.e2e

# What varies from run to run, the times and rates: replaced by a mark on both sides.
_VOLATILE = (
    (r"samples/s \d+$", "samples/s <rate>"),
    (r"^(\[rank0\]: (?:time_s|samples_per_s|tokens_per_s) +)\S+$", r"\1<time>"),
    (r"^(\[rank0\]: comm_share_per_rank +)\[.*\]$", r"\1<shares>"),
)


def test_the_main_job_prints_what_getting_started_shows(tmp_path) -> None:
    shown = block("main-job-output")
    assert shown.commands() == ["make run"]
    sample = shown.output()
    # make run is this command (the Makefile's run target, NPROC=4)
    makefile = (ROOT / "Makefile").read_text()
    assert "launch --standalone --nproc-per-node $(NPROC) examples/digits.py" in makefile
    script = str(ROOT / "examples" / "digits.py")
    done = subprocess.run(  # in a fresh directory, as a first run in a fresh clone
        [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "4", script],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_shows(sample, done.stdout, _VOLATILE, same_numbers=True)


def test_charlm_prints_what_getting_started_shows(tmp_path) -> None:
    shown = block("charlm-output")
    (command,) = shown.commands()
    argv = command.split()
    assert argv[0] == ".venv/bin/shardwire"
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = run([SHARDWIRE, *argv[1:]], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_shows(shown.output(), done.stdout, _VOLATILE, same_numbers=True)


def test_the_worker_script_of_getting_started_runs(tmp_path) -> None:
    (tmp_path / "script.py").write_text(block("sample-worker-script").text)
    launch = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "script.py"]
    done = run(launch, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_first_script_runs_as_written(tmp_path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A first script", 1)[1].split("\n## ", 1)[0]
    (tmp_path / "first.py").write_text(block("readme-first-script").text)
    (command,) = block("readme-first-launch").commands()
    argv = command.split()
    assert argv[0] == ".venv/bin/shardwire"
    done = run([SHARDWIRE, *argv[1:]], cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # every rank prints its rank and what its left neighbour sent: the sum 0+1+2+3
    got = sorted(re.findall(r"^\[rank(\d)\]: (\d) \[6\. 6\. 6\. 6\.\]$", done.stdout, re.M))
    assert got == [(str(r), str(r)) for r in range(4)], done.stdout
    # and what the README says of it without a launcher
    assert "stops at\nonce and prints the command above" in section
    alone = subprocess.run(
        [sys.executable, "first.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={k: v for k, v in env().items() if k not in LAUNCHER_VARIABLES},
        timeout=120,
        check=False,
    )
    assert alone.returncode == 2
    assert "shardwire launch --standalone --nproc-per-node 2 first.py" in alone.stderr
