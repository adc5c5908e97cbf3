"""Live recovery through real processes (``--recovery live``): ranks SIGKILLed while
digits trains are started anew, the survivors keep their processes and re-form, every
rank rolls back to its peers' in-memory copies (or the disk checkpoint), and the run
ends with the fault-free run's every logged loss and accuracy, bit for bit. A script
that never re-forms falls back to relaunching its ranks and says what it must call; a
spent restart budget ends the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.procs import children, cmdline, running

from .cli import ROOT, SCRIPTS, SHARDWIRE, env, run_records, start_coordinator

pytestmark = pytest.mark.e2e
DIGITS = ["examples/digits.py", "--steps", "60", "--log-every", "10"]


def _launch(
    tmp_path: Path,
    name: str,
    *flags: str,
    plan: str = "",
    script: list[str] = DIGITS,
    args: tuple[str, ...] = (),
    **extra: str,
):
    """``shardwire launch`` of 4 ranks with ``flags``, the script with ``args``, the chaos
    ``plan`` (TOML) injected and its log kept; returns the finished process and the log's
    entries."""
    log = tmp_path / f"{name}.jsonl"
    log.write_text("")
    chaos: list[str] = []
    if plan:
        (tmp_path / f"{name}.toml").write_text(plan)
        chaos = ["--chaos", str(tmp_path / f"{name}.toml")]
    done = subprocess.run(
        [
            SHARDWIRE,
            "launch",
            "--standalone",
            "--nproc-per-node",
            "4",
            *flags,
            *chaos,
            *script,
            *args,
            *(["--run-dir", str(tmp_path / name)] if script is DIGITS else []),
        ],
        cwd=ROOT,
        env=env(SHARDWIRE_CHAOS_LOG=str(log), **extra),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    entries = [json.loads(line) for line in log.read_text().splitlines()] if plan else []
    assert not plan or entries, done.stderr[-3000:]
    return done, entries


def _pids(entries: list[dict]) -> dict[int, list[int]]:
    """Each rank's process id in each generation it joined, in order."""
    out: dict[int, list[int]] = defaultdict(list)
    for e in sorted((e for e in entries if e["event"] == "joined"), key=lambda e: e["generation"]):
        out[e["rank"]].append(e["pid"])
    return dict(out)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, dict]:
    """The fault-free run every recovered one must equal."""
    tmp = tmp_path_factory.mktemp("straight")
    done, _ = _launch(tmp, "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_records(tmp / "run")


def _same(run: Path, straight: tuple[dict, dict]) -> None:
    records, summary = run_records(run)
    assert records == straight[0]
    for key in ("final_loss", "held_out_accuracy"):
        assert summary[key] == straight[1][key]


KILLS = """
seed = 1
[[faults]]
kind = "kill"
rank = 1
step = 30
[[faults]]
kind = "kill"
rank = 2
step = 45
"""


def test_survivors_keep_their_processes_and_peers_copies_restore_the_run_exactly(
    tmp_path, straight
) -> None:
    live = ["--max-restarts", "2", "--recovery", "live"]
    done, entries = _launch(tmp_path, "run", *live, plan=KILLS, args=("--copy-every", "5"))
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path / "run", straight)  # every loss and accuracy, bit for bit
    pids = _pids(entries)
    # generations 1, 2 and 3: ranks 0 and 3 never restarted, 1 and 2 once each
    assert {r: len(set(p)) for r, p in pids.items()} == {0: 1, 1: 2, 2: 2, 3: 1}
    assert all(len(p) == 3 for p in pids.values())
    assert pids[1][1] == pids[1][2] and pids[2][0] == pids[2][1]
    # from memory, not disk: there is none; the newest complete copy before each kill
    # (the killed rank never sent its copy of the step it died at)
    assert "resuming" in done.stdout and "at step 25" in done.stdout
    assert "at step 40" in done.stdout
    assert done.stderr.count("started anew") == 2
    # each replacement is forked by the node's fork server, as the ranks were
    assert "rank 1 killed by signal SIGKILL; started anew, forked" in done.stderr


def test_diloco_replicas_roll_back_to_their_copies_and_outer_state_bit_identical(
    tmp_path,
) -> None:
    """DiLoCo (2 replicas of 2 ranks, 2 streaming fragments, each exchange overlapped
    with a step, int8): each killed rank's inner state comes back from its copy, its
    outer state (with an exchange in flight) from its outer group's survivor."""
    args = (
        "--diloco",
        "10",
        "--replicas",
        "2",
        "--fragments",
        "2",
        "--overlap",
        "--outer-quantize",
        "int8",
        "--copy-every",
        "5",
    )
    done, _ = _launch(tmp_path, "straight", args=args)
    assert done.returncode == 0, done.stderr[-3000:]
    live = ["--max-restarts", "2", "--recovery", "live"]
    done, entries = _launch(tmp_path, "run", *live, plan=KILLS, args=args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 25" in done.stdout and "at step 40" in done.stdout  # from the copies
    assert len([e for e in entries if e["event"] == "injected"]) == 2
    _same(tmp_path / "run", run_records(tmp_path / "straight"))


@pytest.mark.long(30)
def test_under_no_shard_kills_at_random_times_end_bit_identical(tmp_path) -> None:
    """NO_SHARD: every rank holds every value, so where ranks die mid-step the survivors
    go on from the last step they all completed (a replica's live state), and where one
    dies in a step's logging, from the copies (every 20 steps). Either way the run ends
    bit for bit as the one without faults (the live path alone: the unit tests)."""
    times = (0.8, 1.3, 1.0)  # after each rank's joining (again after a re-formation)
    plan = "seed = 3\n" + "".join(
        f'[[faults]]\nkind = "kill"\nrank = "random"\nafter_s = {t}\n' for t in times
    )
    # long enough for all three kills (about 5 ms a step on a quiet machine, slower
    # under load): a forked replacement joins within a fraction of a second, so the
    # faults' times are most of the run
    args = ("--steps", "900", "--strategy", "no_shard", "--copy-every", "20")
    done, _ = _launch(tmp_path, "straight", args=args)
    assert done.returncode == 0, done.stderr[-3000:]
    live = ["--max-restarts", "5", "--recovery", "live"]
    done, entries = _launch(tmp_path, "run", *live, plan=plan, args=args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len([e for e in entries if e["event"] == "injected"]) >= 2, "too short for the plan"
    _same(tmp_path / "run", run_records(tmp_path / "straight"))


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_a_mesh_s_ranks_roll_back_to_their_groups_copies_and_end_bit_identical(
    tmp_path, layout
) -> None:
    """charlm split over tensor-parallel slices or pipeline stages, copies every 5 steps
    (each kept within the ranks of one slice or stage): rank 1 is SIGKILLed at step 22,
    every rank of the mesh goes on from step 20, and every logged loss equals the run
    without the failure."""
    small = [
        "examples/charlm.py",
        "--steps",
        "40",
        "--log-every",
        "5",
        "--dim",
        "32",
        "--layers",
        "2",
        "--heads",
        "4",
        "--sample",
        "5",
        *layout,
    ]
    done, _ = _launch(tmp_path, "straight", script=small, args=("--run-dir", str(tmp_path / "a")))
    assert done.returncode == 0, done.stderr[-3000:]
    plan = 'seed = 1\n[[faults]]\nkind = "kill"\nrank = 1\nstep = 22\n'
    live = ["--max-restarts", "1"]  # live recovery: the default
    done, _ = _launch(
        tmp_path,
        "run",
        *live,
        plan=plan,
        script=small,
        args=("--copy-every", "5", "--run-dir", str(tmp_path / "b")),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming" in done.stdout and "at step 20" in done.stdout, done.stdout[-2000:]
    lines = [(tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("a", "b")]
    losses = [[(json.loads(x)["step"], json.loads(x)["loss"]) for x in run] for run in lines]
    assert losses[0] == losses[1] and len(losses[0]) == 8


def test_a_rank_sent_sigterm_hands_its_state_over_and_no_completed_step_is_lost(
    tmp_path, straight
) -> None:
    """SIGTERM (a preemption notice) reaches rank 2 at step 32: it goes on to the next
    copy step (35), every copy lands, it leaves, and its replacement and the survivors go
    on from step 35, not from the copy before the notice (30)."""
    plan = 'seed = 1\n[[faults]]\nkind = "term"\nrank = 2\nstep = 32\n'
    live = ["--max-restarts", "1", "--recovery", "live"]
    done, entries = _launch(tmp_path, "run", *live, plan=plan, args=("--copy-every", "5"))
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path / "run", straight)
    assert {r: len(set(p)) for r, p in _pids(entries).items()} == {0: 1, 1: 1, 2: 2, 3: 1}
    assert "rank 2 got SIGTERM: it leaves at its next copy step" in done.stderr
    assert "rank 2 left on SIGTERM after handing its state at step 35 to rank 3" in done.stderr
    assert "at step 35" in done.stdout and "at step 30" not in done.stdout


def test_without_copies_the_ranks_roll_back_to_the_disk_checkpoint_in_their_processes(
    tmp_path, straight
) -> None:
    plan = 'seed = 1\n[[faults]]\nkind = "kill"\nrank = 3\nstep = 35\n'
    disk = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "20")
    live = ("--max-restarts", "1", "--recovery", "live")
    # every process started on its own (the environment's switch for --no-fork)
    done, entries = _launch(tmp_path, "run", *live, plan=plan, args=disk, SHARDWIRE_FORK_RANKS="0")
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path / "run", straight)
    assert {r: len(set(p)) for r, p in _pids(entries).items()} == {0: 1, 1: 1, 2: 1, 3: 2}
    assert "at step 20" in done.stdout
    assert "rank 3 killed by signal SIGKILL; started anew (pid" in done.stderr
    assert "forked" not in done.stderr


def test_a_script_that_never_re_forms_is_relaunched_and_told_what_to_call(tmp_path) -> None:
    plan = 'seed = 1\n[[faults]]\nkind = "kill"\nrank = 2\nstep = 10\n'
    done, entries = _launch(
        tmp_path,
        "steps",
        "--max-restarts",
        "1",
        "--recovery",
        "live",
        plan=plan,
        script=[str(SCRIPTS / "steps.py")],
        STEPS="30",
        STEP_DELAY="0.02",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pg = await session.reform(error)" in done.stderr
    # every rank ran again in a new process: the job fell back to a relaunch
    assert all(len(set(p)) == 2 for p in _pids(entries).values())


def test_a_spent_restart_budget_ends_the_job_naming_the_last_failure(tmp_path) -> None:
    live = ["--max-restarts", "1", "--recovery", "live"]
    done, _ = _launch(tmp_path, "run", *live, plan=KILLS, args=("--copy-every", "5"))
    assert done.returncode != 0
    assert "rank 2" in done.stderr and "no restart is left" in done.stderr


def test_bench_copies_measures_the_overhead_and_a_restore(tmp_path) -> None:
    out = tmp_path / "copies.json"
    done = subprocess.run(
        [
            SHARDWIRE,
            "bench",
            "copies",
            "--nproc",
            "2",
            "--rounds",
            "1",
            "--steps",
            "3",
            "--every",
            "1",
            "3",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["overhead"]) == {"1", "3"} and result["state_bytes_per_rank"] > 0
    # the copies every step were last taken at step 6 (3 steps without, then 3 with)
    assert result["restored_step"] == 6 and 0 < result["restore_s"] < 60
    assert "peer copies" in done.stdout


def _node(
    port: int,
    name: str,
    run_dir: Path,
    *,
    nnodes: str,
    copy_every: int = 5,
    flags=(),
    steps: int = 300,
    args=(),
) -> subprocess.Popen:
    return subprocess.Popen(
        [
            SHARDWIRE,
            "worker",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "2",
            "--node-id",
            name,
            "--run-id",
            "nodes",
            "--max-restarts",
            "2",
            "--recovery",
            "live",
            *flags,
            *DIGITS_LONG,
            "--run-dir",
            str(run_dir),
            "--copy-every",
            str(copy_every),
            "--steps",
            str(steps),
            *args,
        ],
        cwd=ROOT,
        env=env(**NODES_TOKEN),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


NODES_TOKEN = {"SHARDWIRE_TOKEN": "nodes-token"}
DIGITS_LONG = ["examples/digits.py", "--steps", "300", "--log-every", "10"]


def _two_nodes(
    tmp_path: Path,
    name: str,
    *,
    lose_b_at: str | None,
    shrink: bool = False,
    notice: bool = False,
    copy_every: int = 5,
    args: tuple[str, ...] = (),
) -> tuple[dict, dict]:
    """digits on two nodes (agents a and b, two ranks each) under a coordinator; with
    ``lose_b_at``, node b's agent is SIGKILLed (with ``notice``, sent SIGTERM) once rank
    0 logs that step, and a new agent for b is started (with ``shrink``, none is: the
    job, ``--nnodes 1:2``, goes on with node a alone); ``args``: digits's own. Returns
    node a's run records."""
    nnodes = "1:2" if shrink else "2"
    size = ["--nnodes", nnodes, "--last-call", "2"] if shrink else ["--world-size", "4"]
    coordinator, port = start_coordinator(
        *size, "--run-id", "nodes", "--max-restarts", "2", "--http-port", "-1", **NODES_TOKEN
    )
    run = tmp_path / name
    a = _node(int(port), "a", run, nnodes=nnodes, copy_every=copy_every, args=args)
    b_flags = ["--term-timeout", "0.5"]  # a notice's grace is --leave-timeout's, not this
    b = _node(
        int(port),
        "b",
        tmp_path / f"{name}-b",
        nnodes=nnodes,
        copy_every=copy_every,
        flags=b_flags,
        args=args,
    )
    procs = [coordinator, a, b]
    try:
        if lose_b_at is not None:
            assert a.stdout is not None
            while line := a.stdout.readline():
                if lose_b_at in line:
                    break
            assert line, "the job ended before node b could be lost"
            (server,) = [p for p in children(b.pid) if b"launcher.forkserver" in cmdline(p)]
            orphans = children(server)  # its ranks, forked by the node's fork server
            assert len(orphans) == 2
            if notice:  # a preemption notice: its ranks hand their state over and leave
                os.kill(b.pid, signal.SIGTERM)
                _out, err = b.communicate(timeout=60)
                (tmp_path / f"{name}-b.err").write_text(err)
            else:  # its ranks are orphans: they must not re-form
                os.kill(b.pid, signal.SIGKILL)
                b.wait(timeout=30)
            if not shrink:
                b2 = tmp_path / f"{name}-b2"
                procs.append(again := _node(int(port), "b", b2, nnodes=nnodes, args=args))
                _out, err = again.communicate(timeout=240)
                (tmp_path / f"{name}-b2.err").write_text(err)
                assert again.returncode == 0, err[-3000:]
            # and its fork server ends by itself: its socket closed with the agent
            deadline = time.monotonic() + 60
            while [pid for pid in [*orphans, server] if running(pid)]:
                assert time.monotonic() < deadline, "node b's processes outlived its agent"
                time.sleep(0.2)
        out, err = a.communicate(timeout=240)
        (tmp_path / f"{name}-a.out").write_text(out)  # kept for a failure's reader
        (tmp_path / f"{name}-a.err").write_text(err)
        assert a.returncode == 0, err[-3000:]
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
            rest = proc.communicate(timeout=60)
            (tmp_path / f"{name}-{i}.rest").write_text(f"{rest[0]}\n{rest[1]}")
    if lose_b_at is not None and not notice:  # from the copies, not step 0 (no checkpoint)
        resumed = re.search(r"resuming .* at step (\d+)", out)
        # at or after the last copy before step 100 (the kill may land a few steps later
        # than the line that triggered it on a busy machine)
        assert resumed and int(resumed.group(1)) >= 95, f"{err[-4000:]}\n{out[-1500:]}"
    return run_records(run)


@pytest.fixture(scope="module")
def two_nodes_straight(tmp_path_factory) -> tuple[dict, dict]:
    """The two-node run without faults the lost-node runs are held to."""
    return _two_nodes(tmp_path_factory.mktemp("nodes"), "straight", lose_b_at=None)


def test_a_lost_node_is_replaced_and_its_ranks_restore_from_copies_on_the_other(
    tmp_path, two_nodes_straight
) -> None:
    straight = two_nodes_straight
    recovered = _two_nodes(tmp_path, "recovered", lose_b_at="step 100/300")
    assert recovered[0] == straight[0]  # the copies of ranks 2 and 3 were on node a
    for key in ("final_loss", "held_out_accuracy"):
        assert recovered[1][key] == straight[1][key]


DILOCO_NODES = ("--diloco", "10", "--fragments", "2", "--overlap")


@pytest.mark.long(30)
def test_a_lost_diloco_replica_is_restored_from_the_other_replica_s_memory(tmp_path) -> None:
    """DiLoCo with one replica per node: node b, a whole replica, is lost at step 100.
    Its ranks' inner state comes back from the copies node a's ranks held, its outer
    state from node a's ranks (the same in every replica), and the run ends as the
    fault-free one, bit for bit."""
    straight = _two_nodes(tmp_path, "straight", lose_b_at=None, args=DILOCO_NODES)
    recovered = _two_nodes(tmp_path, "recovered", lose_b_at="step 100/300", args=DILOCO_NODES)
    assert recovered[0] == straight[0]
    for key in ("final_loss", "held_out_accuracy"):
        assert recovered[1][key] == straight[1][key]
    assert recovered[1]["diloco"]["replicas"] == 2


def test_a_lost_node_s_ranks_are_spread_over_the_survivors_from_the_copies_they_held(
    tmp_path, two_nodes_straight
) -> None:
    """``--nnodes 1:2``: node b is lost and not replaced; node a's two ranks re-form in
    their processes as a job of two and restore every rank's part from the copies in
    their memory (the lost ranks' were on node a), not from step 0: in-memory restores
    at another world size are held bit for bit to the checkpoint's in the unit tests."""
    straight = two_nodes_straight
    records, summary = _two_nodes(tmp_path, "shrunk", lose_b_at="step 100/300", shrink=True)
    out = (tmp_path / "shrunk-a.out").read_text()
    assert summary["workers"] == 2, out[-1500:]
    found = re.search(r"resuming .* at step (\d+)", out)
    assert found and int(found.group(1)) >= 95, out[-1500:]  # the copies' step, not 0
    resumed = int(found.group(1))
    # the steps before the loss are the four-rank run's, bit for bit
    assert {s: r for s, r in records.items() if s <= resumed} == {
        s: r for s, r in straight[0].items() if s <= resumed
    }
    assert summary["held_out_accuracy"] > 0.9


# node b, started at step 50, joined at step 201 on a quiet machine and at 103 beside a
# busy loop per core (node a's steps slow more than b's start): 800 leaves room for both
STEPS_GROW = 800


@pytest.mark.long(30)
@pytest.mark.timeout(300)
def test_a_node_that_joins_grows_the_job_around_the_running_ranks(tmp_path) -> None:
    """``--nnodes 1:2``: node a trains alone (two ranks); node b joins at step 50. The job
    grows to four ranks in a new generation, node a's ranks re-forming in their
    processes and every rank going on from their state (no rollback to step 0), and it
    finishes on both nodes."""
    coordinator, port = start_coordinator(
        "--nnodes",
        "1:2",
        "--last-call",
        "2",
        "--run-id",
        "nodes",
        "--max-restarts",
        "1",
        "--http-port",
        "-1",
        **NODES_TOKEN,
    )
    a = _node(int(port), "a", tmp_path / "grow", nnodes="1:2", steps=STEPS_GROW)
    procs = [coordinator, a]
    try:
        assert a.stdout is not None
        while line := a.stdout.readline():
            if f"step 50/{STEPS_GROW}" in line:
                break
        assert line, "the job ended before node b joined"
        b = _node(int(port), "b", tmp_path / "grow-b", nnodes="1:2", steps=STEPS_GROW)
        procs.append(b)
        out, err = a.communicate(timeout=240)
        b_out, b_err = b.communicate(timeout=240)
        assert a.returncode == 0, err[-3000:]
        assert b.returncode == 0, b_err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=60)
    assert "membership change: node 'b' joined" in err, err[-3000:]
    assert "started anew" not in err  # node a's ranks kept their processes
    found = re.search(r"resuming .* at step (\d+)", out)
    assert found and int(found.group(1)) >= 50, out[-2000:]
    assert json.loads((tmp_path / "grow" / "summary.json").read_text())["workers"] == 4


def test_a_node_sent_sigterm_hands_its_ranks_state_over_before_it_goes(tmp_path) -> None:
    """``--nnodes 1:2``, copies every 100 steps: node b's agent is sent SIGTERM (a
    preemption notice) at step 110. Its ranks go on to the next copy step, 200, which
    is more than node b's ``--term-timeout`` (0.5 s) away but within ``--leave-timeout``
    (30 s): there every copy lands, they leave, and node a's ranks go on alone from that
    step, not from the copy before the notice (100). Node b takes no part in the next
    generation: the job re-forms once, at two ranks."""
    records, summary = _two_nodes(
        tmp_path, "noticed", lose_b_at="step 110/300", shrink=True, notice=True, copy_every=100
    )
    out = (tmp_path / "noticed-a.out").read_text()
    err = (tmp_path / "noticed-b.err").read_text()
    assert "left on SIGTERM after handing its state at step" in err, err[-3000:]
    told = (tmp_path / "noticed-a.err").read_text()
    found = re.search(r"resuming .* at step (\d+)", out)
    # node a's stderr says what its ranks restored (or refused), node b's how it left
    assert found and int(found.group(1)) >= 200, f"{err[-2500:]}\n{told[-4000:]}\n{out[:1500]}"
    assert summary["workers"] == 2 and summary["held_out_accuracy"] > 0.9
    assert "job finished after 2 generations (1 restarts)" in told
    assert "starting generation 3" not in told  # node b did not join generation 2


def test_kills_at_random_times_mid_collective_or_mid_copy_still_end_bit_identical(
    tmp_path,
) -> None:
    """Ranks drawn from a seed SIGKILLed at times not tied to steps, so they die anywhere
    in one (in a collective, with a copy on the wire, in compute); each time every rank
    rolls back to a step all can restore, and the run ends exactly as the fault-free one."""
    # after each rank's joining (again after a re-formation); a step takes ~5 ms on a quiet
    # machine, so the run is ~3 s and the first two kills fall in its first half
    times = (0.4, 0.9, 0.6, 1.1)
    plan = "seed = 7\n" + "".join(
        f'[[faults]]\nkind = "kill"\nrank = "random"\nafter_s = {t}\n' for t in times
    )
    args = ("--steps", "600", "--copy-every", "3")
    steps = ["examples/digits.py", "--log-every", "10"]
    straight, _ = _launch(
        tmp_path, "straight", script=steps, args=(*args, "--run-dir", str(tmp_path / "straight"))
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    live = ["--max-restarts", "10", "--recovery", "live"]
    done, entries = _launch(
        tmp_path,
        "run",
        *live,
        plan=plan,
        script=steps,
        args=(*args, "--run-dir", str(tmp_path / "run")),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kills = [e for e in entries if e["event"] == "injected"]
    assert len(kills) >= 2, "the run was too short for the plan"
    records, summary = run_records(tmp_path / "run")
    expected, expected_summary = run_records(tmp_path / "straight")
    assert records == expected
    assert summary["final_loss"] == expected_summary["final_loss"]
    # every kill replaced one process; the others kept theirs
    assert len({e["pid"] for e in entries if e["event"] == "joined"}) == 4 + len(kills)


def test_a_hung_rank_is_killed_by_its_agent_and_replaced(tmp_path, straight) -> None:
    """A rank stopped (SIGSTOP) stops heartbeating; the coordinator fails it, and under
    live recovery its agent kills that process, which is still there, and starts it
    anew; the others re-form and the run ends as the fault-free one."""
    plan = 'seed = 1\n[[faults]]\nkind = "stop"\nrank = 3\nstep = 30\nfor_s = 30\n'
    live = ["--max-restarts", "1", "--recovery", "live"]
    done, entries = _launch(tmp_path, "run", *live, plan=plan, args=("--copy-every", "5"))
    assert done.returncode == 0, done.stderr[-3000:]
    _same(tmp_path / "run", straight)
    assert "rank 3 failed while its process runs (hung?)" in done.stderr
    assert {r: len(set(p)) for r, p in _pids(entries).items()} == {0: 1, 1: 1, 2: 1, 3: 2}
