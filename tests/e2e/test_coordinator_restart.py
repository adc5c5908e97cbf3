"""A coordinator that may die, through real processes: SIGKILLed while digits trains and
started again on its state directory and address, the job trains on meanwhile and ends
exactly as an uninterrupted run; one that does not come back ends the job after the
grace, with one error naming it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.etcdserver import free_ports
from tests.procs import children, cmdline

from .cli import ROOT, SCRIPTS, SHARDWIRE, env, shardwire
from .journaled import (
    STEPS,
    TOKEN,
    node_agent,
    same_as_straight,
    stop,
    straight_run,
    token_file,
    until_step,
)
from .pageruns import page_argv

pytestmark = pytest.mark.e2e


def _coordinator(tmp_path: Path, port: int, *, grace: float) -> subprocess.Popen:
    """The failures page's coordinator (its world size, token file and state directory
    the test's), on ``port`` (0: a free one, said in the port file)."""
    given = {
        "--world-size": "2",
        "--token-file": str(token_file(tmp_path)),
        "--state-dir": str(tmp_path / "state"),
    }
    argv = page_argv("coordinator-state-dir", given)
    return subprocess.Popen(
        [
            *argv,
            "--port",
            str(port),
            "--port-file",
            str(tmp_path / "port"),
            "--run-id",
            "restart",
            "--http-port",
            "-1",
            "--coordinator-grace",
            str(grace),
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _port(tmp_path: Path, coordinator: subprocess.Popen) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (tmp_path / "port").read_text() if (tmp_path / "port").exists() else ""
        if text.strip():
            return int(text)
        assert coordinator.poll() is None, coordinator.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.05)
    raise AssertionError("the coordinator did not say its port within 60 s")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[list, dict]:
    return straight_run(tmp_path_factory.mktemp("straight"))


def test_a_coordinator_killed_and_restarted_loses_no_step(tmp_path, straight) -> None:
    first = _coordinator(tmp_path, 0, grace=60)
    port = _port(tmp_path, first)
    agent = node_agent(port, tmp_path / "restarted")
    second = None
    try:
        until_step(agent, 300)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert (tmp_path / "state" / "journal.json").exists()
        until_step(agent, 500)  # it trains on while the coordinator is away
        second = _coordinator(tmp_path, port, grace=60)
        out, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
        assert second.wait(timeout=60) == 0  # the restarted one saw the job finish
    finally:
        stop(agent, first, *([second] if second else []))
    assert "reconnected to the coordinator" in err
    same_as_straight(tmp_path / "restarted", straight)
    assert not (tmp_path / "state" / "journal.json").exists()  # the job is over


def test_a_coordinator_that_does_not_come_back_ends_the_job_after_the_grace(tmp_path) -> None:
    coordinator = _coordinator(tmp_path, 0, grace=3)
    port = _port(tmp_path, coordinator)
    agent = node_agent(port, tmp_path / "run")
    try:
        until_step(agent, 200)
        os.kill(coordinator.pid, signal.SIGKILL)
        killed = time.monotonic()
        _out, err = agent.communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        stop(agent, coordinator)
    assert agent.returncode != 0
    assert "did not come back within 3 s" in err and f"127.0.0.1:{port}" in err
    assert 2.5 < waited < 60  # the grace, then the end (not at once, not a hang)
    assert json.loads((tmp_path / "state" / "journal.json").read_text())["generation"] == 1


@pytest.mark.parametrize("after_s", [0.1, 0.4, 0.8, 1.2])
def test_a_coordinator_killed_while_the_job_forms_is_taken_back_and_the_job_trains(
    tmp_path, after_s: float
) -> None:
    """``launch --standalone`` restarts its coordinator on its journal; killed at points
    that fall before the node is assigned, while its workers start and join, or once it
    runs, the job forms and finishes all the same (the chaos verdict: it survived)."""
    plan = 'expect = "survive"\n[[faults]]\nkind = "kill"\nrank = "coordinator"\n'
    plan += f"after_s = {after_s}\n"
    (tmp_path / "plan.toml").write_text(plan)
    done = shardwire(
        *("chaos", str(tmp_path / "plan.toml"), "--verdict", str(tmp_path / "v.json"), "--"),
        *(SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "examples/digits.py"),
        *("--steps", "40", "--run-dir", str(tmp_path / "run")),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads((tmp_path / "v.json").read_text())
    assert outcome["faults"][0]["injected"] and outcome["survived"]
    assert "starting it again on" in done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 40


def test_a_coordinator_killed_while_the_job_restarts_finishes_the_restart(tmp_path) -> None:
    """Rank 1 is killed at step 5; rank 0 takes 3 s to end on its agent's SIGTERM, so the
    job is between generations when its coordinator is SIGKILLed too. The launcher
    starts it again on its journal, which holds the restart: the agent rejoins, hears of
    it, and generation 2 forms and finishes."""
    plan = tmp_path / "plan.toml"
    plan.write_text('[[faults]]\nkind = "kill"\nrank = 1\nstep = 5\n')
    log = tmp_path / "chaos.jsonl"
    launch = subprocess.Popen(
        [
            SHARDWIRE,
            "launch",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--recovery",
            "relaunch",
            "--term-timeout",
            "20",
            "--chaos",
            str(plan),
            str(SCRIPTS / "steps.py"),
        ],
        cwd=ROOT,
        env=env(SHARDWIRE_CHAOS_LOG=str(log), STEPS="20", STEP_DELAY="0.05", TERM_DELAY="3"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and '"injected"' not in (
            log.read_text() if log.exists() else ""
        ):
            assert launch.poll() is None, "the job ended before rank 1 was killed"
            time.sleep(0.05)
        time.sleep(1.0)  # the coordinator saw it; rank 0 is ending, slowly
        (coordinator,) = [p for p in children(launch.pid) if b"coordinator" in cmdline(p)]
        os.kill(coordinator, signal.SIGKILL)
        _out, err = launch.communicate(timeout=240)
    finally:
        stop(launch)
    assert launch.returncode == 0, err[-3000:]
    assert "the coordinator was killed (signal 9)" in err
    assert "restarted from its journal while the job restarted" in err
    assert "job finished after 2 generations (1 restarts)" in err


def _child_of(pid: int) -> int:
    """The one child process of ``pid`` (bounded wait for it to start)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise AssertionError(f"process {pid} started no child within 60 s")


def test_a_respawning_coordinator_killed_by_a_signal_comes_back_in_place(
    tmp_path, straight
) -> None:
    """``--respawn``: the coordinator process SIGKILLed (as the OOM killer does in its
    container) is started again by the one that supervises it, on its state directory
    and port; the job ends exactly as an uninterrupted run, and so does the supervisor."""
    (port,) = free_ports(1)
    log = tmp_path / "coordinator.log"
    with log.open("w") as out:
        supervisor = subprocess.Popen(
            [
                SHARDWIRE,
                "coordinator",
                "--port",
                str(port),
                "--world-size",
                "2",
                "--run-id",
                "restart",
                "--state-dir",
                str(tmp_path / "state"),
                "--http-port",
                "-1",
                "--respawn",
                "2",
            ],
            cwd=ROOT,
            env=env(**TOKEN),
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    agent = node_agent(port, tmp_path / "respawned")
    try:
        until_step(agent, 300)
        first = _child_of(supervisor.pid)
        os.kill(first, signal.SIGKILL)
        _out, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
        assert supervisor.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        stop(agent, supervisor)
    said = "killed by signal 9; starting it again on its state directory (1 of 2)"
    assert said in log.read_text()
    assert "reconnected to the coordinator" in err
    same_as_straight(tmp_path / "respawned", straight)


def test_a_respawning_coordinator_stopped_with_sigterm_stays_stopped(tmp_path) -> None:
    (port,) = free_ports(1)
    supervisor = subprocess.Popen(
        [
            SHARDWIRE,
            "coordinator",
            "--port",
            str(port),
            "--world-size",
            "2",
            "--state-dir",
            str(tmp_path / "state"),
            "--http-port",
            "-1",
            "--respawn",
            "3",
        ],
        cwd=ROOT,
        env=env(**TOKEN),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert supervisor.stderr is not None
        assert "listening on" in supervisor.stderr.readline()
        supervisor.terminate()  # as `docker stop` does: the coordinator hears it too
        _out, err = supervisor.communicate(timeout=60)
    finally:
        stop(supervisor)
    assert supervisor.returncode == 128 + signal.SIGTERM, err
    assert "starting it again" not in err
    refused = subprocess.run(
        [SHARDWIRE, "coordinator", "--port", "0", "--respawn", "3", "--http-port", "-1"],
        cwd=ROOT,
        env=env(**TOKEN),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert "--respawn needs --state-dir and a --port" in refused.stderr


def test_a_job_that_finishes_while_its_coordinator_is_away_ends_well_when_it_is_back(
    tmp_path, straight
) -> None:
    """The coordinator SIGKILLed and started again 10 s later: the ranks train on and
    finish meanwhile, keep their last word until it is back, deliver it once, and the
    job ends as an uninterrupted run (every process exits 0, nothing left pending)."""
    first = _coordinator(tmp_path, 0, grace=60)
    port = _port(tmp_path, first)
    agent = node_agent(port, tmp_path / "run", output=tmp_path / "agent")
    second = None
    try:
        deadline = time.monotonic() + 240
        while "step 300/" not in (tmp_path / "agent.out").read_text():
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(first.pid, signal.SIGKILL)
        killed = time.monotonic()
        first.wait(timeout=30)
        while f"step {STEPS}/" not in (tmp_path / "agent.out").read_text():
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(max(0.0, killed + 10 - time.monotonic()))  # away 10 s
        second = _coordinator(tmp_path, port, grace=60)
        assert agent.wait(timeout=120) == 0, (tmp_path / "agent.err").read_text()[-3000:]
        assert second.wait(timeout=60) == 0
    finally:
        stop(agent, first, *([second] if second else []))
    err = (tmp_path / "agent.err").read_text()
    for who in ("[rank0]: worker:", "[rank1]: worker:"):  # each kept its last word for it
        assert err.count(f"{who} lost the coordinator") == 1, err[-3000:]
        assert err.count(f"{who} reconnected to the coordinator") == 1, err[-3000:]
    # The agent has no last word of its own: it is back on the coordinator only if it is
    # still there when its ranks, once they have delivered theirs, end. It never gives up.
    assert err.count("agent: lost the coordinator") == 1, err[-3000:]
    assert "did not come back" not in err and "refused to take it back" not in err
    assert "Task was destroyed" not in err
    same_as_straight(tmp_path / "run", straight)
