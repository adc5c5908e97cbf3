"""``shardwire chaos``: every kind of process fault injected into a real 4-rank job, as a
user runs it, and seen in the verdict."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from shardwire.worker.chaos.faultlog import read_log
from shardwire.worker.transport.shmfiles import SHM_DIR, segment_names
from tests.docblocks import block

from .cli import ROOT, SCRIPTS, SHARDWIRE, run, start_coordinator

pytestmark = pytest.mark.e2e


def _run(
    command: list[str], cwd: Path, timeout: float, **extra: str
) -> subprocess.CompletedProcess:
    return run(command, cwd=cwd, timeout=timeout, **extra)


CASES = {
    # kind: (the fault's table, the plan's expectation, the rank the others must name)
    "kill": ("rank = 2\nstep = 5", 'expect = "fail"\nexpect_within_s = 20', 2),
    "raise": ("rank = 1\nstep = 5", 'expect = "fail"\nexpect_within_s = 20', 1),
    "term": ("rank = 3\nstep = 5", 'expect = "fail"\nexpect_within_s = 20', 3),
    "stop": ("rank = 1\nafter_s = 1.0\nfor_s = 1.0", 'expect = "survive"', None),
    "block": ("rank = 0\nstep = 5\nfor_s = 1.0", 'expect = "survive"', None),
}


def _under_plan(
    tmp_path, plan: str, command: list[str], timeout: float, *extra: str, **env: str
) -> tuple[subprocess.CompletedProcess, dict]:
    """``shardwire chaos plan.toml --verdict verdict.json EXTRA -- COMMAND`` in
    ``tmp_path``: what it printed and its verdict ({} when it wrote none)."""
    (tmp_path / "plan.toml").write_text(plan)
    verdict = tmp_path / "verdict.json"
    chaos = [SHARDWIRE, "chaos", str(tmp_path / "plan.toml"), "--verdict", str(verdict)]
    done = _run([*chaos, *extra, "--", *command], tmp_path, timeout, **env)
    return done, (json.loads(verdict.read_text()) if verdict.exists() else {})


def _chaos(
    tmp_path, plan: str, *extra: str, transport: str = "auto", run_id: str = "", **more: str
) -> tuple[subprocess.CompletedProcess, dict]:
    launch = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "4"]
    launch += ["--run-id", run_id] if run_id else []
    return _under_plan(
        tmp_path,
        plan,
        [*launch, str(SCRIPTS / "steps.py")],
        180,
        *extra,
        STEPS="30",
        STEP_DELAY="0.1",
        SIZE="4096",
        SHARDWIRE_TRANSPORT=transport,
        **more,
    )


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_fault_is_injected_and_judged(tmp_path, kind: str) -> None:
    where, expect, named = CASES[kind]
    plan = f'seed = 1\n{expect}\n\n[[faults]]\nkind = "{kind}"\n{where}\n'
    done, outcome = _chaos(tmp_path, plan)
    assert done.returncode == 0, done.stderr[-3000:]  # the plan's expectation held
    (fault,) = outcome["faults"]
    assert fault["injected"], done.stderr[-3000:]
    assert fault["rank"] == int(where.split()[2])
    if named is None:  # survived: every rank ended well and the job exited 0
        assert outcome["survived"] and set(outcome["ranks_ended"].values()) == {"ok"}
        assert "detected_by" not in fault
    else:
        assert not outcome["survived"]
        assert fault["named_rank"] == named, fault
        assert fault["detected_by"] != named and fault["detected_after_s"] < 20
    assert f"fault 0 ({kind}) on rank {fault['rank']}" in done.stderr


def test_an_expectation_that_does_not_hold_fails_the_command(tmp_path) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "kill"\nrank = 1\nstep = 3\n'
    done, outcome = _chaos(tmp_path, plan)
    assert done.returncode == 1
    assert "expected: survive: did NOT hold" in done.stderr
    assert outcome["faults"][0]["injected"] and not outcome["held"]


def test_a_bad_plan_stops_before_the_job_starts(tmp_path) -> None:
    done, outcome = _chaos(tmp_path, '[[faults]]\nkind = "kill"\nrank = 1\n')
    assert done.returncode == 2 and outcome == {}
    assert "faults.0: give exactly one of step, after_s, every_s and collective" in done.stderr
    assert "[coordinator]" not in done.stderr  # nothing was started


def test_a_job_without_a_plan_injects_and_notes_nothing(tmp_path) -> None:
    log = tmp_path / "chaos.jsonl"  # a log named, but no plan: nothing may run
    done = _run(
        [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "steps.py")],
        tmp_path,
        120,
        STEPS="3",
        SHARDWIRE_CHAOS_LOG=str(log),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not log.exists()


GUIDE = ROOT / "docs" / "guide" / "chaos.md"


def _guide_command(plan: str) -> tuple[list[str], dict[str, str]]:
    """The page's command that runs ``plan`` (the first one's, with its name, when the
    plan has none of its own), as arguments and the variables it sets."""
    labels = ["chaos-rank-dies", "chaos-coordinator-dies", "chaos-slow-link", "chaos-live"]
    commands = [c for label in labels for c in block(label).commands()]
    assert all("shardwire chaos" in c for c in commands)
    command = next((c for c in commands if plan in c), None)
    if command is None:
        command = commands[0].replace("rank-dies.toml", plan)
    args = shlex.split(command)
    variables = dict(a.split("=", 1) for a in args[: args.index("shardwire")])
    return args[args.index("shardwire") + 1 :], variables


def _as_written(tmp_path: Path, args: list[str], variables: dict[str, str], timeout: float):
    """The page's command in ``tmp_path``, where its relative paths hold."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return _run(
        [SHARDWIRE, *args],
        tmp_path,
        timeout,
        PATH=f"{Path(SHARDWIRE).parent}:{os.environ.get('PATH', '')}",
        **variables,
    )


PLANS = [
    "rank-dies.toml",
    "rank-stalls.toml",
    "script-raises.yaml",
    "coordinator-dies.toml",
    "slow-link.toml",
]


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_the_guide_runs_each_example_plan_against_digits(tmp_path, plan: str) -> None:
    args, variables = _guide_command(plan)
    if "--verdict" not in args:
        at = args.index("--")
        args[at:at] = ["--verdict", "verdict.json"]
    done = _as_written(tmp_path, args, variables, 240)
    assert done.returncode == 0, done.stderr[-3000:]  # the example's expectation held
    outcome = json.loads((tmp_path / "verdict.json").read_text())
    assert outcome["held"] and outcome["faults"][0]["injected"]
    assert plan == "rank-dies.toml" or outcome["survived"] or plan == "script-raises.yaml"
    if plan == "rank-dies.toml":  # what the page shows, but for times and the error's words
        shown = GUIDE.read_text()
        sample = re.search(r"```text\n(.*?)```", shown, re.S)
        assert sample is not None
        printed = done.stderr[done.stderr.index("chaos verdict") :].strip()
        assert _steady(printed) == _steady(sample.group(1).strip())


def _steady(text: str) -> str:
    text = re.sub(r"\d+\.\d+ s", "<s>", text)
    # the error's own words end the line (they may hold parentheses of their own); the
    # survivor learns of the death from its link, or is stopped first by its node agent
    return re.sub(r"\(\w+: .*\)$", "(<error>: <why>)", text, flags=re.M)


NETWORK = {
    # kind: (the fault's table, the expectation, the ranks the others may name): a reset
    # link is lost at both its ends, so either end may be the first to report it
    "delay": ("rank = 1\nstep = 3\nfor_s = 1.0\ndelay_s = 0.05", 'expect = "survive"', None),
    "throttle": ("rank = 3\nstep = 3\nfor_s = 1.0\nrate_mbps = 50", 'expect = "survive"', None),
    "blackhole": ("rank = 2\nstep = 3\nfor_s = 1.0\npeer = 3", 'expect = "survive"', None),
    "flip": ("rank = 1\nstep = 3\npeer = 0", 'expect = "fail"\nexpect_within_s = 20', {1}),
    "reset": ("rank = 0\nstep = 3\npeer = 1", 'expect = "fail"\nexpect_within_s = 20', {0, 1}),
}


@pytest.mark.parametrize("kind", sorted(NETWORK))
def test_each_network_fault_is_injected_into_the_ranks_own_links(tmp_path, kind: str) -> None:
    where, expect, named = NETWORK[kind]
    plan = f'seed = 1\n{expect}\n\n[[faults]]\nkind = "{kind}"\n{where}\n'
    # sockets only (no node arena), and payloads large enough to corrupt (SIZE)
    done, outcome = _chaos(tmp_path, plan, transport="tcp")
    assert done.returncode == 0, done.stderr[-3000:]
    (fault,) = outcome["faults"]
    assert fault["injected"] and fault["step"] >= 3
    if named is not None:
        assert fault["named_rank"] in named, fault
    else:
        assert outcome["survived"]


@pytest.mark.parametrize("kind", ["kill", "stop"])
def test_the_launcher_injects_faults_into_its_coordinator(tmp_path, kind: str) -> None:
    # a killed coordinator is started again from its journal and the ranks reconnect; a
    # stop shorter than the ranks' patience with it is waited out
    timing = "after_s = 2.0" + ("\nfor_s = 1.0" if kind == "stop" else "")
    fault = f'[[faults]]\nkind = "{kind}"\nrank = "coordinator"\n{timing}\n'
    plan = f'seed = 1\nexpect = "survive"\n\n{fault}'
    done, outcome = _chaos(tmp_path, plan)
    assert done.returncode == 0, done.stderr[-3000:]
    (fault,) = outcome["faults"]
    assert fault["injected"] and fault["rank"] == "coordinator"
    assert f"fault 0 ({kind}) on the coordinator" in done.stderr
    assert outcome["survived"] and set(outcome["ranks_ended"].values()) == {"ok"}
    # when it was back: started again by the launcher, or continued after for_s
    assert fault["back"] == ("started again" if kind == "kill" else "continued")
    assert 0 < fault["back_after_s"] < 30
    if kind == "kill":
        assert (
            "starting it again" in done.stderr and "reconnected to the coordinator" in done.stderr
        )
        if fault.get("while_forming"):  # a loaded machine: the kill came before any join
            assert fault["lost_by"] == [] and "the job was forming" in done.stderr
        else:  # every rank lost its connection and was taken back, after it was back
            assert fault["lost_by"] == [0, 1, 2, 3], done.stderr[-3000:]
            assert "not_reconnected" not in fault
            assert fault["back_after_s"] <= fault["reconnected_after_s"] < 60
            assert "all 4 ranks that lost it reconnected after" in done.stderr
    else:
        assert fault["back_after_s"] >= 1.0  # its stop lasted for_s


def test_launch_chaos_injects_a_plan_without_a_verdict(tmp_path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text('[[faults]]\nkind = "kill"\nrank = 1\nstep = 3\n')
    done = _run(
        [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "--chaos", str(plan)]
        + [str(SCRIPTS / "steps.py")],
        tmp_path,
        120,
        STEPS="30",
        STEP_DELAY="0.05",
    )
    assert done.returncode != 0
    assert "rank 1 (local rank 1)" in done.stderr and "SIGKILL" in done.stderr
    (injected,) = [e for e in read_log(Path(f"{plan}.log")) if e["event"] == "injected"]
    assert (injected["rank"], injected["fault"], injected["step"]) == (1, 0, 3)


def test_a_traced_job_shows_each_fault_on_its_timeline(tmp_path) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "block"\nrank = 1\nstep = 3\nfor_s = 0.3\n'
    (tmp_path / "plan.toml").write_text(plan)
    done = _run(
        [SHARDWIRE, "chaos", str(tmp_path / "plan.toml"), "--", SHARDWIRE, "launch"]
        + ["--standalone", "--nproc-per-node", "2", "--trace", "--run-id", "traced"]
        + [str(SCRIPTS / "steps.py")],
        tmp_path,
        120,
        STEPS="10",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = json.loads((tmp_path / "traces" / "traced" / "job.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    faults = [e for e in events if e.get("cat") == "chaos"]
    assert [(f["name"], f["args"]["fault"]) for f in faults] == [("fault: block", 0)]


def test_a_rank_whose_file_limit_is_lowered_runs_with_that_limit(tmp_path) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "nofile"\nrank = 1\nstep = 3\nlimit = 200\n'
    done, outcome = _chaos(tmp_path, plan, SHOW_NOFILE="1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert outcome["faults"][0]["injected"]
    limits = sorted(re.findall(r"^\[rank(\d)\]: nofile (\d+)$", done.stdout, re.M))
    assert limits[1] == ("1", "200") and limits[0][1] != "200"


def test_shm_fill_during_a_job_is_swept_with_the_run(tmp_path) -> None:
    stats = os.statvfs(SHM_DIR)
    used = 100 * (1 - stats.f_bavail / stats.f_blocks)
    plan = 'expect = "survive"\n[[faults]]\nkind = "shm_fill"\nrank = 0\nstep = 2\n'
    plan += f"percent = {min(99.0, used + 1.0):.2f}\n"
    done, outcome = _chaos(tmp_path, plan, run_id="chaos-fill")
    assert done.returncode == 0, done.stderr[-3000:]
    assert outcome["faults"][0]["injected"] and outcome["survived"]
    assert segment_names("chaos-fill") == []  # the node agent removed the filler with the run


@pytest.mark.long(60)
def test_bench_goodput_trains_through_random_kills_beside_a_clean_run(tmp_path) -> None:
    out = tmp_path / "goodput.json"
    done = _run(
        [SHARDWIRE, "bench", "goodput", "--nproc", "2", "--every", "3", "--minutes", "0.1"]
        + ["--save-every", "5", "--copy-every", "5", "--json", str(out)],
        ROOT,
        600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"relaunch", "live"} and result["mode"] == "relaunch"
    for key in ("goodput", "steps_lost", "recovery_s"):  # the headline: the default's
        assert result[key] == result["modes"]["relaunch"][key]
    for mode, r in result["modes"].items():
        assert r["finished"] and r["faults"] >= 1, (mode, r)
        # the ratio of the two runs' times (above 1 when load slowed the fault-free one)
        assert r["goodput"] > 0
        assert r["goodput"] == pytest.approx(r["clean_s"] / r["faulty_s"], abs=0.01)
        assert len(r["recovery_s"]) >= 1 and all(t > 0 for t in r["recovery_s"])
        assert r["steps_lost"] >= 0
    # a relaunch starts every rank again, live recovery only the killed one
    relaunch, live = result["modes"]["relaunch"], result["modes"]["live"]
    assert relaunch["processes"] % 2 == 0 and relaunch["processes"] >= 4
    assert live["processes"] == 2 + live["faults"]
    assert "goodput" in done.stdout and "live" in done.stdout


@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_a_fault_at_a_collective_strikes_inside_that_call(tmp_path, kind: str) -> None:
    plan = (
        'expect = "fail"\nexpect_within_s = 20\nexpect_names = 2\n'
        f'[[faults]]\nkind = "{kind}"\nrank = 2\ncollective = 7\n'
    )
    done, outcome = _chaos(tmp_path, plan)
    assert done.returncode == 0, done.stderr[-3000:]  # failed fast, naming rank 2
    (fault,) = outcome["faults"]
    assert (fault["collective"], fault["op"]) == (7, "all_reduce"), fault
    assert (
        f"fault 0 ({kind}) on rank 2" in done.stderr
        and "in collective 7 (all_reduce)" in done.stderr
    )


NODE_TOKEN = "node-faults-token"


def _two_nodes(tmp_path: Path, plan: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``shardwire chaos`` over one command that starts two node agents (two ranks each)
    of a job whose coordinator runs apart, as two machines' agents would."""
    coordinator, port = start_coordinator(
        "--world-size",
        "4",
        "--run-id",
        "nodes",
        "--http-port",
        "-1",
        SHARDWIRE_TOKEN=NODE_TOKEN,
    )

    def agent(node: int) -> str:
        return shlex.join(
            [
                SHARDWIRE,
                "worker",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--run-id",
                "nodes",
                "--node-id",
                f"n{node}",
                "--node-rank",
                str(node),
                str(SCRIPTS / "steps.py"),
            ]
        )

    both = (
        f'{agent(0)} & a=$!; {agent(1)}; b=$?; wait $a; a=$?; [ "$a" = 0 ] && exit "$b"; exit "$a"'
    )
    try:
        return _under_plan(
            tmp_path,
            plan,
            ["sh", "-c", both],
            180,
            STEPS="40",
            STEP_DELAY="0.1",
            SHARDWIRE_TOKEN=NODE_TOKEN,
        )
    finally:
        coordinator.kill()
        coordinator.communicate(timeout=60)


@pytest.mark.parametrize("kind", ["kill", "term"])
def test_a_lost_node_takes_its_agent_and_ranks_and_the_other_node_names_one(
    tmp_path, kind: str
) -> None:
    plan = f'expect = "fail"\nexpect_within_s = 30\n[[faults]]\nkind = "{kind}"\nnode = 1\n'
    done, outcome = _two_nodes(tmp_path, plan + "after_s = 2\n")
    assert done.returncode == 0, done.stderr[-3000:]
    (fault,) = outcome["faults"]
    assert fault["rank"] == "node 1" and fault["named_rank"] in (2, 3), fault
    assert fault["detected_by"] in (0, 1)  # a rank of the node that is left
    assert f"fault 0 ({kind}) on node 1" in done.stderr


def test_a_node_frozen_shorter_than_the_heartbeat_timeout_is_waited_for(tmp_path) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "stop"\nnode = 1\nafter_s = 2\nfor_s = 2\n'
    done, outcome = _two_nodes(tmp_path, plan)
    assert done.returncode == 0, done.stderr[-3000:]
    (fault,) = outcome["faults"]
    assert fault["injected"] and fault["rank"] == "node 1" and outcome["survived"]
    assert set(outcome["ranks_ended"].values()) == {"ok"}


def test_the_guides_live_recovery_holds_every_invariant_and_equals_the_clean_run(
    tmp_path,
) -> None:
    """The page's live.toml and command: digits under NO_SHARD (every rank a replica)
    with a rank killed and recovered live, from the survivors' live state: the replicas
    agree at every step, no step runs twice, and every step's state and loss equal the
    clean run's, which the same command (``{run}`` in it) ran first."""
    text = GUIDE.read_text()
    plans = re.findall(r"```toml\n(.*?)```", text, re.S)
    (plan,) = [p for p in plans if 'compare = "clean"' in p]
    (tmp_path / "live.toml").write_text(plan)
    args, variables = _guide_command("live.toml")
    at = args.index("--")
    args[at:at] = ["--verdict", "verdict.json"]
    done = _as_written(tmp_path, args, variables, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs" / "clean" / "summary.json").exists()
    assert (tmp_path / "runs" / "faulty" / "summary.json").exists()
    checks = json.loads((tmp_path / "verdict.json").read_text())["invariants"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "replicas_agree": "held",
        "steps_in_order": "held",
        "data_once": "not checked",
        "as_clean": "held",
    }
    # what the page says: 60 steps of four replicas; the survivors went on from step 30,
    # the last step they completed, in the state they held: no step ran twice, so data
    # once had nothing to compare
    assert checks["replicas_agree"]["compared"] >= 60
    assert checks["data_once"]["why"] == "no step ran again: no second reading to compare"
    assert checks["as_clean"]["compared"] >= 4 * 60
    assert "invariant as clean" in done.stderr and "shardwire chaos: the clean run" in done.stderr
    # the verdict is the chaos section of the faulty run's summary, not the clean one's
    summary = json.loads((tmp_path / "runs" / "faulty" / "summary.json").read_text())
    assert summary["chaos"]["held"] and summary["chaos"]["invariants"] == checks
    assert "final_loss" in summary
    assert "chaos" not in json.loads((tmp_path / "runs" / "clean" / "summary.json").read_text())


@pytest.mark.parametrize("forget", [False, True])
def test_a_restart_that_forgets_its_data_order_breaks_data_once(tmp_path, forget: bool) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "kill"\nrank = 1\nstep = 10\n'
    (tmp_path / "state").mkdir()
    launch = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts"]
    done, outcome = _under_plan(
        tmp_path,
        plan,
        [*launch, "1", "--recovery", "relaunch", str(SCRIPTS / "forgetful.py")],
        180,
        STEPS="20",
        STATE_DIR=str(tmp_path / "state"),
        FORGET=str(int(forget)),
    )
    assert outcome["survived"], done.stderr[-3000:]
    checks = outcome["invariants"]
    assert checks["replicas_agree"]["status"] == checks["steps_in_order"]["status"] == "held"
    assert checks["data_once"]["status"] == ("broken" if forget else "held"), checks
    assert done.returncode == int(forget)  # broken invariants fail the command
    if forget:
        assert "BROKEN: rank" in done.stderr and "read other samples at step" in done.stderr


def test_a_slow_disk_holds_a_ranks_checkpoints_and_the_job_finishes(tmp_path) -> None:
    plan = 'expect = "survive"\n[[faults]]\nkind = "slow_disk"\nrank = 1\nstep = 3\n'
    launch = [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "4"]
    digits = [str(ROOT / "examples" / "digits.py"), "--steps", "20", "--save-every", "5"]
    done, outcome = _under_plan(
        tmp_path,
        plan + "for_s = 4.0\ndelay_s = 0.5\n",
        [*launch, *digits, "--checkpoint-dir", "ckpt", "--run-dir", "run"],
        240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert outcome["faults"][0]["injected"] and outcome["survived"]
    assert (tmp_path / "ckpt" / "step-00000020").is_dir()  # the saves finished all the same
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["chaos"]["held"]


def test_the_same_plan_and_seed_replay_the_same_faults(tmp_path) -> None:
    """A random rank drawn from the seed, twice: the same rank at the same step both
    times, and the verdict names the seed; another seed may draw another rank."""
    plan = 'seed = 11\nexpect = "fail"\n[[faults]]\nkind = "raise"\nrank = "random"\nstep = 4\n'
    hits = []
    for attempt in ("a", "b"):
        (tmp_path / attempt).mkdir()
        done, outcome = _chaos(tmp_path / attempt, plan)
        assert done.returncode == 0, done.stderr[-3000:]
        (fault,) = outcome["faults"]
        hits.append((outcome["seed"], fault["rank"], fault["step"]))
        assert "chaos verdict (seed 11)" in done.stderr
    assert hits[0] == hits[1] and hits[0][2] == 4


@pytest.mark.long(70)
@pytest.mark.timeout(900)
def test_bench_goodput_trains_torch_charlm_through_kills_in_alternating_pairs(tmp_path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (`make torch` installs it)")
    out = tmp_path / "goodput.json"
    done = _run(
        [SHARDWIRE, "bench", "goodput", "--torch", "ddp", "--pairs", "2", "--recovery", "live"]
        + ["--nproc", "2", "--every", "3", "--minutes", "0.1", "--copy-every", "5"]
        + ["--json", str(out)],
        ROOT,
        840,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["workload"] == "torch charlm (ddp)" and len(result["pairs"]) == 2
    live = result["modes"]["live"]
    each = [p["modes"]["live"]["goodput"] for p in result["pairs"]]
    assert live["goodput_pairs"] == each and live["goodput_range"] == [min(each), max(each)]
    assert live["goodput"] == round(sorted(each)[0] / 2 + sorted(each)[1] / 2, 3)
    for pair in result["pairs"]:
        r = pair["modes"]["live"]
        assert r["finished"] and r["faults"] >= 1 and r["processes"] == 2 + r["faults"], r
    # a line per stage, with the time left once a stage has run, then the whole run's time
    *stages, last = [line for line in done.stderr.splitlines() if line.startswith("[goodput] ")]
    assert [s.split(":")[0] for s in stages] == [f"[goodput] {i}/4" for i in range(1, 5)]
    assert "fault-free job" in stages[0] and stages[0].endswith(" in)")
    for stage in stages[1:]:
        assert re.search(r" \((\d|\.)+ (s|min|h) in; about (\d|\.)+ (s|min|h) left\)$", stage)
    assert re.fullmatch(r"\[goodput\] done: 4 stages in (\d|\.)+ (s|min|h)", last)
