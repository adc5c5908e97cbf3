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

from shardwire.coordinator.etcd import EtcdClient
from tests.etcdserver import etcd_server, free_ports

from .cli import ROOT, SCRIPTS, SHARDWIRE, env, run_records

pytestmark = pytest.mark.e2e
TOKEN = {"SHARDWIRE_TOKEN": "restart-token"}
STEPS = "1500"


def _coordinator(tmp_path: Path, port: int, *, grace: float) -> subprocess.Popen:
    return subprocess.Popen(
        [SHARDWIRE, "coordinator", "--port", str(port), "--port-file", str(tmp_path / "port"),
         "--world-size", "2", "--run-id", "restart", "--state-dir", str(tmp_path / "state"),
         "--http-port", "-1", "--coordinator-grace", str(grace)],
        cwd=ROOT, env=env(**TOKEN), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _port(tmp_path: Path, coordinator: subprocess.Popen) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (tmp_path / "port").read_text() if (tmp_path / "port").exists() else ""
        if text.strip():
            return int(text)
        assert coordinator.poll() is None, coordinator.stderr.read()  # type: ignore[union-attr]
        time.sleep(0.05)
    raise AssertionError("the coordinator did not say its port within 60 s")


def _agent(port: int | str, run_dir: Path) -> subprocess.Popen:
    where = port if isinstance(port, str) else f"127.0.0.1:{port}"
    return subprocess.Popen(
        [SHARDWIRE, "worker", "--coordinator", where, "--nnodes", "1",
         "--nproc-per-node", "2", "--run-id", "restart", "examples/digits.py", "--steps", STEPS,
         "--log-every", "100", "--run-dir", str(run_dir)],
        cwd=ROOT, env=env(**TOKEN), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _until_step(agent: subprocess.Popen, step: int) -> None:
    assert agent.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = agent.stdout.readline()
        assert line, "the job ended before the coordinator could be killed"
        if f"step {step}/" in line:
            return
    raise AssertionError(f"step {step} not reached within 240 s")


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[list, dict]:
    """The records of the same job run without a fault."""
    where = tmp_path_factory.mktemp("straight")
    done = subprocess.run(
        [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "examples/digits.py",
         "--steps", STEPS, "--log-every", "100", "--run-dir", str(where / "run")],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return run_records(where / "run")


def _same_as_straight(run_dir: Path, straight: tuple[list, dict]) -> None:
    records, summary = run_records(run_dir)
    expected, expected_summary = straight
    assert records == expected  # every logged loss, rate and accuracy, bit for bit
    for key in ("final_loss", "held_out_accuracy"):
        assert summary[key] == expected_summary[key]


def test_a_coordinator_killed_and_restarted_loses_no_step(tmp_path, straight) -> None:
    first = _coordinator(tmp_path, 0, grace=60)
    port = _port(tmp_path, first)
    agent = _agent(port, tmp_path / "restarted")
    second = None
    try:
        _until_step(agent, 300)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert (tmp_path / "state" / "journal.json").exists()
        _until_step(agent, 500)  # it trains on while the coordinator is away
        second = _coordinator(tmp_path, port, grace=60)
        out, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
        assert second.wait(timeout=60) == 0  # the restarted one saw the job finish
    finally:
        _stop(agent, first, *([second] if second else []))
    assert "reconnected to the coordinator" in err
    _same_as_straight(tmp_path / "restarted", straight)
    assert not (tmp_path / "state" / "journal.json").exists()  # the job is over


def test_a_coordinator_that_does_not_come_back_ends_the_job_after_the_grace(tmp_path) -> None:
    coordinator = _coordinator(tmp_path, 0, grace=3)
    port = _port(tmp_path, coordinator)
    agent = _agent(port, tmp_path / "run")
    try:
        _until_step(agent, 200)
        os.kill(coordinator.pid, signal.SIGKILL)
        killed = time.monotonic()
        _out, err = agent.communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        _stop(agent, coordinator)
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
    done = subprocess.run(
        [SHARDWIRE, "chaos", str(tmp_path / "plan.toml"), "--verdict", str(tmp_path / "v.json"),
         "--", SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "examples/digits.py",
         "--steps", "40", "--run-dir", str(tmp_path / "run")],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads((tmp_path / "v.json").read_text())
    assert outcome["faults"][0]["injected"] and outcome["survived"]
    assert "starting it again on" in done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 40


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = cmdline
    return found


def test_a_coordinator_killed_while_the_job_restarts_finishes_the_restart(tmp_path) -> None:
    """Rank 1 is killed at step 5; rank 0 takes 3 s to end on its agent's SIGTERM, so the
    job is between generations when its coordinator is SIGKILLed too. The launcher
    starts it again on its journal, which holds the restart: the agent rejoins, hears of
    it, and generation 2 forms and finishes."""
    plan = tmp_path / "plan.toml"
    plan.write_text('[[faults]]\nkind = "kill"\nrank = 1\nstep = 5\n')
    log = tmp_path / "chaos.jsonl"
    launch = subprocess.Popen(
        [SHARDWIRE, "launch", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--term-timeout", "20", "--chaos", str(plan), str(SCRIPTS / "steps.py")],
        cwd=ROOT, env=env(SHARDWIRE_CHAOS_LOG=str(log), STEPS="20", STEP_DELAY="0.05",
                          TERM_DELAY="3"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and '"injected"' not in (
            log.read_text() if log.exists() else ""
        ):
            assert launch.poll() is None, "the job ended before rank 1 was killed"
            time.sleep(0.05)
        time.sleep(1.0)  # the coordinator saw it; rank 0 is ending, slowly
        (coordinator,) = [p for p, c in _children(launch.pid).items() if "coordinator" in c]
        os.kill(coordinator, signal.SIGKILL)
        _out, err = launch.communicate(timeout=240)
    finally:
        _stop(launch)
    assert launch.returncode == 0, err[-3000:]
    assert "the coordinator was killed (signal 9)" in err
    assert "restarted from its journal while the job restarted" in err
    assert "job finished after 2 generations (1 restarts)" in err


def _replica(tmp_path: Path, etcd: str, port: int) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"replica-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [SHARDWIRE, "coordinator", "--port", str(port), "--world-size", "2", "--run-id",
             "restart", "--etcd", etcd, "--http-port", "-1", "--coordinator-grace", "60"],
            cwd=ROOT, env=env(**TOKEN), stdout=subprocess.DEVNULL, stderr=out, text=True,
        )  # fmt: skip
    return proc, log


def _leader(replicas: dict[int, tuple[subprocess.Popen, Path]], among: list[int]) -> int:
    """The port of the replica among ``among`` that says it leads (bounded wait)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for port in among:
            if "shardwire coordinator: leading run " in replicas[port][1].read_text():
                return port
        time.sleep(0.02)
    raise AssertionError("no replica led within 60 s")


def test_three_replicas_over_etcd_a_killed_leader_is_replaced_and_no_step_is_lost(
    tmp_path, straight
) -> None:
    """Three coordinator replicas share the job through a real etcd; the leader is
    SIGKILLed while digits trains: a standby leads within a few seconds, the node agent
    and its ranks follow it, and the job ends exactly as an uninterrupted run."""
    ports = free_ports(3)
    first = ports[0]  # it leads: the address every process dials first is the one lost
    with etcd_server(tmp_path / "etcd") as etcd:
        replicas = {first: _replica(tmp_path, etcd, first)}
        agent = None
        try:
            assert _leader(replicas, [first]) == first
            replicas |= {port: _replica(tmp_path, etcd, port) for port in ports[1:]}
            agent = _agent(",".join(f"127.0.0.1:{p}" for p in ports), tmp_path / "ha")
            _until_step(agent, 300)
            os.kill(replicas[first][0].pid, signal.SIGKILL)
            killed = time.monotonic()
            second = _leader(replicas, [p for p in ports if p != first])
            took = time.monotonic() - killed
            _out, err = agent.communicate(timeout=300)
            assert agent.returncode == 0, err[-3000:]
            codes = {port: proc.wait(timeout=60) for port, (proc, _) in replicas.items()}
        finally:
            _stop(*([agent] if agent else []), *(proc for proc, _ in replicas.values()))
        logs = {port: log.read_text() for port, (_, log) in replicas.items()}
    assert codes[first] == -signal.SIGKILL and codes[second] == 0, logs
    (third,) = set(ports) - {first, second}
    assert codes[third] == 0 and "run 'restart' finished under another replica" in logs[third]
    assert f"standby: 127.0.0.1:{first}" in logs[second]  # it waited, then led
    assert took < 15, took  # the lease (2 s) lapses, a standby leads: figures in the docs
    assert f"reconnected to the coordinator at 127.0.0.1:{second}" in err
    _same_as_straight(tmp_path / "ha", straight)


def test_a_replica_leases_for_its_etcd_ttl_and_an_etcd_that_does_not_answer_is_named(
    tmp_path,
) -> None:
    (port, dead) = free_ports(2)
    with etcd_server(tmp_path / "etcd") as etcd:
        log = tmp_path / "replica.log"
        with log.open("w") as out:
            replica = subprocess.Popen(
                [SHARDWIRE, "coordinator", "--port", str(port), "--world-size", "2", "--run-id",
                 "ttl", "--etcd", etcd, "--etcd-ttl", "7", "--http-port", "-1"],
                cwd=ROOT, env=env(**TOKEN), stdout=subprocess.DEVNULL, stderr=out, text=True,
            )  # fmt: skip
        try:
            assert _leader({port: (replica, log)}, [port]) == port
            client = EtcdClient([etcd])
            key = client.get("/shardwire/ttl/leader")
            assert key is not None and key.value.decode().startswith(f"127.0.0.1:{port} (PID ")
            lease = client.call("/v3/lease/timetolive", {"ID": str(key.lease)})
            assert int(lease["grantedTTL"]) == 7
        finally:
            _stop(replica)
    unanswered = subprocess.run(
        [SHARDWIRE, "coordinator", "--port", str(port), "--etcd", f"127.0.0.1:{dead}",
         "--http-port", "-1"],
        cwd=ROOT, env=env(**TOKEN), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert unanswered.returncode == 2, unanswered.stderr
    assert f"no etcd endpoint answered /v3/lease/grant (http://127.0.0.1:{dead}: " in (
        unanswered.stderr
    )
