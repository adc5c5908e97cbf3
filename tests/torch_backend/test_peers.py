"""The peers ``bench goodput --compare-torchft`` times beside shardwire: torchft's DDP
(a lighthouse, a replica group per rank, a killed replica started again and healed from
a live peer) and torchrun over gloo from its checkpoint on disk, each under a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwire.worker.bench import goodput
from shardwire.worker.bench.peers import torchft_job, torchft_python, torchrun_job
from shardwire.worker.chaos.plan import Fault, Scheduled

from .lazy import skip_without_torch

skip_without_torch()

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--dim=32", "--heads=2", "--layers=1", "--batch=8", "--context=16", "--wrap=ddp"]


def _kill(rank: int, at_s: float) -> Scheduled:
    fault = Fault(kind="kill", rank=rank, after_s=at_s)
    return Scheduled(index=0, fault=fault, rank=rank, at_s=at_s)


@pytest.fixture
def in_checkout(monkeypatch):
    monkeypatch.chdir(ROOT)  # the peers train examples/torch_charlm.py of the checkout


@pytest.mark.long(20)
@pytest.mark.e2e
def test_torchft_replicas_train_every_step_through_a_kill(tmp_path, in_checkout):
    python = torchft_python(None)
    if python is None:
        pytest.skip("no interpreter with torchft (make torchft-venv)")
    steps = 2000
    run = torchft_job(
        python,
        [*SMALL, f"--steps={steps}"],
        nproc=2,
        work=tmp_path / "ft",
        schedule=[_kill(1, 6.0)],
        timeout=110,
    )
    assert run.finished, (tmp_path / "ft").iterdir()
    assert (run.faults, run.processes) == (1, 3)  # replica 1 started again once
    done = [json.loads((tmp_path / "ft" / f"replica-{r}.json").read_text()) for r in (0, 1)]
    assert [d["steps"] for d in done] == [steps, steps]
    # whether the replicas ended alike (torchft's healing is not always exact: a healed
    # replica can end with other parameters than its peer)
    assert run.agree == (done[0]["digest"] == done[1]["digest"])
    assert not any(_alive(pid) for pid in run.pids)


@pytest.mark.long(20)
@pytest.mark.e2e
def test_torchrun_starts_every_worker_again_after_a_kill_and_ends_them_all(tmp_path, in_checkout):
    """torchrun stops both workers at the kill and starts both again. Its restarted gloo
    workers do not always meet again (torch 2.13: a connection refused at an address of
    the killed generation, then a hang), so the run is bounded: at its limit every
    process it started is ended, and a run that did finish trained every step."""
    run = torchrun_job(
        ROOT / "examples" / "torch_charlm.py",
        [*SMALL, "--steps=1500", "--save-every=50"],
        nproc=2,
        work=tmp_path / "tr",
        schedule=[_kill(0, 6.0)],
        timeout=35,
    )
    assert run.faults == 1 and run.processes >= 4, run.detail  # both started again
    assert run.wall_s < 35 + 15  # bounded, the workers' ends included
    assert not any(_alive(pid) for pid in run.pids)
    if run.finished:
        summary = json.loads((tmp_path / "tr" / "run" / "summary.json").read_text())
        assert summary["steps"] == 1500 and summary["backend"] == "gloo"
        assert any((tmp_path / "tr" / "checkpoints").glob("step-*/done"))


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie awaiting its reaper has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    "argv",
    [
        ["--compare-torchft"],
        ["--torch", "fsdp2", "--compare-torchft"],
        ["--torch", "ddp", "--kind", "term", "--compare-torchft"],
    ],
)
def test_compare_torchft_is_refused_outside_ddp_under_kills(argv, capsys):
    assert goodput.main(argv) == 2
    assert "give --torch ddp --kind kill" in capsys.readouterr().err


def test_compare_torchft_without_torchft_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(goodput, "torchft_python", lambda *a: None)
    assert goodput.main(["--torch", "ddp", "--compare-torchft"]) == 2
    assert "pip install torchft-nightly" in capsys.readouterr().err
