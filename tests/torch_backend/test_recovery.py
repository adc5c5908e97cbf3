"""Live recovery of a torch job: DDP and FSDP2 ranks that survive a rank's death (in
its backward pass, or in its optimizer step) re-form the default group in their
processes (``shardwire.torch.recovering``), reload the newest
``torch.distributed.checkpoint`` (from the file system, or from the ranks' memory with
``PeerStorage``: the replacement's part from its holder's copy), and end with the
parameters of a run without the failure, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .lazy import skip_without_torch

skip_without_torch()

from tests.e2e.cli import background, start_coordinator  # noqa: E402

from .spawn import PROGS, launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROG = str(PROGS / "reform.py")


def _final(text: str) -> str:
    found = re.search(r"final ([0-9a-f]{64})", text)
    assert found, text[-3000:]
    return found.group(1)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The final parameters' digest of each wrapping's run without a failure."""
    digests = {}
    for wrap in ("ddp", "fsdp2"):
        root = tmp_path_factory.mktemp(f"straight-{wrap}")
        run = launch("--nproc-per-node", "4", PROG, str(root), "16", "-1", "--wrap", wrap)
        assert run.returncode == 0, run.stderr[-3000:]
        digests[wrap] = _final(run.stdout + run.stderr)
    return digests


# each wrapping killed at each point, and each store under each wrapping; DDP's
# replacement also healed from a survivor's live state, at each point
CASES = [
    ("ddp", "backward", "disk"),
    ("ddp", "step", "peer"),
    ("fsdp2", "backward", "peer"),
    ("fsdp2", "step", "disk"),
    ("ddp", "backward", "heal"),
    ("ddp", "step", "heal"),
]
# where every rank goes on: the newest checkpoint before step 10; from a survivor, the
# step it was in (a kill in the backward pass) or the next (in the optimizer step,
# which the survivors finished)
RESUMES = {"disk": {"backward": 8, "step": 8}, "peer": {"backward": 8, "step": 8}}
RESUMES["heal"] = {"backward": 10, "step": 11}


@pytest.mark.parametrize(("wrap", "during", "store"), CASES)
def test_survivors_re_form_in_their_processes_and_end_as_without_the_failure(
    tmp_path: Path, straight: dict[str, str], wrap: str, during: str, store: str
):
    live = ("--max-restarts", "1", "--recovery", "live")
    kill = ("--wrap", wrap, "--during", during, "--store", store)
    args = (PROG, str(tmp_path), "16", "10", *kill)
    run = launch("--nproc-per-node", "4", *live, *args)
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "SIGSEGV" not in text and "SIGABRT" not in text
    assert "no node arena" not in text, text[-3000:]
    assert _final(text) == straight[wrap], text[-6000:]  # who resumed where, on a mismatch
    pids = {r: re.findall(rf"rank {r} pid (\d+) trains", text) for r in range(4)}
    assert all(len(p) == 2 for p in pids.values()), text[-3000:]
    # the survivors kept their processes; rank 1's was replaced (it died in step 10)
    assert [len(set(pids[r])) for r in range(4)] == [1, 2, 1, 1], text[-3000:]
    assert text.count(f"resumes at step {RESUMES[store][during]}") == 4, text[-3000:]
    if store in ("peer", "heal"):
        assert not list(tmp_path.glob("step-*"))  # nothing went to the file system


def test_a_rank_told_to_leave_hands_its_part_over_and_no_step_is_lost(
    tmp_path: Path, straight: dict[str, str]
):
    live = ("--max-restarts", "1", "--recovery", "live")
    args = (PROG, str(tmp_path), "16", "-1", "--wrap", "fsdp2", "--store", "peer")
    run = launch("--nproc-per-node", "4", *live, *args, "--leave-at", "10")
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-3000:]
    assert "rank 1 got SIGTERM: it leaves at its next PeerStorage.leaving()" in text
    said = "rank 1 left on SIGTERM after handing its state at checkpoint 'step-11' to rank 2"
    assert said in text and "Traceback" not in text, text[-3000:]
    assert _final(text) == straight["fsdp2"]
    pids = {r: re.findall(rf"rank {r} pid (\d+) trains", text) for r in range(4)}
    assert [len(set(pids[r])) for r in range(4)] == [1, 2, 1, 1], text[-3000:]
    # everyone goes on from the step the hand-over saved, not an older checkpoint
    assert text.count("resumes at step 11") == 4


def test_a_lost_node_s_ranks_load_from_the_survivors_memory_in_a_smaller_world(
    tmp_path: Path,
):
    """``--nnodes 1:2``, two ranks on each of nodes a and b, FSDP2, checkpoints in the
    ranks' memory (and on disk, for the oracle) every 4 steps. Node b is lost in step 10
    (its agent and its first rank killed at once); node a's ranks re-form in their
    processes as a world of 2 and load step 8 from ``PeerStorage``: their own parts and
    the copies they held of node b's ranks, resharded by DCP from 4 shards to 2, the same
    bits as the disk checkpoint of step 8 loaded in that world."""
    token = {"SHARDWIRE_TOKEN": "torch-shrink"}
    job = ("--run-id", "torch-shrink", "--max-restarts", "2")
    coordinator, port = start_coordinator(
        "--nnodes", "1:2", "--last-call", "2", "--http-port", "-1", *job, **token
    )
    args = (PROG, str(tmp_path), "16", "-1", "--wrap", "fsdp2", "--store", "both")
    nodes = {
        name: background(
            "worker",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--node-id",
            name,
            "--recovery",
            "live",
            *job,
            *args,
            "--lose-node",
            "b:10",
            **token,
        )
        for name in "ab"
    }
    try:
        out, err = nodes["a"].communicate(timeout=240)
    finally:
        for proc in (*nodes.values(), coordinator):
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)
    text = out + err
    assert nodes["a"].returncode == 0, text[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} restored step 8 in a world of 2 as on disk" in text, text[-3000:]
    assert "final " in text and "Traceback" not in text, text[-3000:]
    pids = {r: set(re.findall(rf"rank {r} pid (\d+) trains", out + err)) for r in (0, 1)}
    assert all(len(p) == 1 for p in pids.values()), text[-3000:]  # node a kept its processes
