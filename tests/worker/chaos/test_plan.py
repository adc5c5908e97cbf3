"""Fault plans: the schema, its errors naming the field, the seeded schedule, and the
verdict drawn from a chaos log."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwire.worker.chaos.faultlog import read_log
from shardwire.worker.chaos.inject import from_environment
from shardwire.worker.chaos.plan import COORDINATOR, MAX_OCCURRENCES, NODE, Plan, PlanError, load
from shardwire.worker.chaos.verdict import table, verdict

TOML = """
seed = 3
expect = "fail"
expect_within_s = 5

[[faults]]
kind = "kill"
rank = 1
step = 20

[[faults]]
kind = "stop"
rank = "random"
after_s = 4.0
for_s = 2.0
"""

YAML = """
seed: 3
expect: fail
expect_within_s: 5
faults:
  - {kind: kill, rank: 1, step: 20}
  - {kind: stop, rank: random, after_s: 4.0, for_s: 2.0}
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_toml_and_yaml_say_the_same_plan(tmp_path) -> None:
    a = load(_write(tmp_path, "p.toml", TOML))
    b = load(_write(tmp_path, "p.yaml", YAML))
    assert a == b
    assert [f.kind for f in a.faults] == ["kill", "stop"]
    assert a.faults[1].for_s == 2.0 and a.expect == "fail"


def test_the_same_seed_draws_the_same_ranks(tmp_path) -> None:
    plan = load(_write(tmp_path, "p.toml", TOML))
    first = [(s.index, s.rank) for s in plan.schedule(64)]
    assert first == [(s.index, s.rank) for s in plan.schedule(64)]
    assert first[0] == (0, 1)
    draws = {plan.model_copy(update={"seed": seed}).schedule(64)[1].rank for seed in range(20)}
    assert len(draws) > 5  # the random rank does depend on the seed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[[faults]]\nkind = 'kill'\nrank = 1\nstep = 2\nwhen = 3\n",
            "faults.0.when: Extra inputs",
        ),
        ("[[faults]]\nkind = 'explode'\nrank = 1\nstep = 2\n", "faults.0.kind: Input should be"),
        (
            "[[faults]]\nkind = 'kill'\nrank = 1\n",
            "faults.0: give exactly one of step, after_s",
        ),
        ("[[faults]]\nkind = 'kill'\nrank = 1\nstep = 1\nevery_s = 3\n", "exactly one of"),
        ("[[faults]]\nkind = 'flip'\nrank = 1\nevery_s = 3\n", "every_s is for kill"),
        ("[[faults]]\nkind = 'kill'\nrank = 1\nstep = 2\nafter_s = 1\n", "exactly one of"),
        ("[[faults]]\nkind = 'stop'\nrank = 1\nstep = 2\n", "a stop fault needs for_s > 0"),
        ("[[faults]]\nkind = 'kill'\nrank = -1\nstep = 2\n", "rank must be 0 or more"),
        ("seed = 1\n", "faults: Field required"),
        ("expect = 'maybe'\n[[faults]]\nkind = 'kill'\nrank = 0\nstep = 1\n", "expect: Input"),
        ("[[faults\n", "is not valid TOML"),
        (
            "[[faults]]\nkind = 'raise'\nrank = 'coordinator'\nafter_s = 1\n",
            "the coordinator takes kill, stop and term, not raise",
        ),
        (
            "[[faults]]\nkind = 'kill'\nrank = 'coordinator'\nstep = 1\n",
            "a fault on the coordinator is timed: give after_s",
        ),
        ("[[faults]]\nkind = 'kill'\nrank = 1\nstep = 1\npeer = 2\n", "peer is for network"),
        ("[[faults]]\nkind = 'delay'\nrank = 1\nstep = 1\nfor_s = 1\n", "delay_s or jitter_s"),
        ("[[faults]]\nkind = 'throttle'\nrank = 1\nstep = 1\nfor_s = 1\n", "rate_mbps > 0"),
        ("[[faults]]\nkind = 'reset'\nrank = 1\nstep = 1\npeer = 1\n", "another rank than"),
        ("[[faults]]\nkind = 'nofile'\nrank = 1\nstep = 1\nlimit = 2\n", "limit >= 3"),
        ("[[faults]]\nkind = 'shm_fill'\nrank = 1\nstep = 1\n", "percent > 0"),
        ("[[faults]]\nkind = 'slow_disk'\nrank = 1\nstep = 1\nfor_s = 5\n", "delay_s > 0"),
        ("[[faults]]\nkind = 'kill'\nstep = 1\n", "give exactly one of rank and node"),
        ("[[faults]]\nkind = 'kill'\nrank = 1\nnode = 1\nafter_s = 1\n", "one of rank and node"),
        ("[[faults]]\nkind = 'raise'\nnode = 1\nafter_s = 1\n", "a node takes kill, stop"),
        ("[[faults]]\nkind = 'kill'\nnode = 1\nstep = 3\n", "a fault on a node is timed"),
        ("[[faults]]\nkind = 'kill'\nnode = -1\nafter_s = 1\n", "faults.0.node: Input should"),
        ("[[faults]]\nkind = 'kill'\nrank = 1\ncollective = 0\n", "faults.0.collective: Input"),
        ("[[faults]]\nkind = 'kill'\nrank = 1\ncollective = 3\nstep = 2\n", "exactly one of"),
        ("[[faults]]\nkind = 'flip'\nrank = 1\ncollective = 3\n", "collective is for kill"),
        ("compare = 'dirty'\n[[faults]]\nkind = 'kill'\nrank = 0\nstep = 1\n", "compare: Input"),
        ("check_every = -1\n[[faults]]\nkind = 'kill'\nrank = 0\nstep = 1\n", "check_every: Input"),
        ("expect_names = -2\n[[faults]]\nkind = 'kill'\nrank = 0\nstep = 1\n", "expect_names"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_field(tmp_path, text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        load(_write(tmp_path, "bad.toml", text))


def test_a_rank_outside_the_world_and_a_missing_file_are_refused(tmp_path) -> None:
    plan = load(_write(tmp_path, "p.toml", TOML))
    with pytest.raises(PlanError, match=r"faults.0.rank: 1 is not a rank of 1"):
        plan.schedule(1)
    with pytest.raises(PlanError, match="cannot read the plan"):
        load(tmp_path / "absent.toml")
    with pytest.raises(PlanError, match="is not valid YAML"):
        load(_write(tmp_path, "p.yaml", "faults: [unclosed"))


def test_coordinator_faults_are_apart_from_the_ranks_draws(tmp_path) -> None:
    with_coordinator = TOML + '\n[[faults]]\nkind = "kill"\nrank = "coordinator"\nafter_s = 9\n'
    plan = load(_write(tmp_path, "c.toml", with_coordinator))
    (on,) = plan.on_coordinator()
    assert (on.index, on.rank) == (2, COORDINATOR)
    before = load(_write(tmp_path, "p.toml", TOML)).schedule(8)
    assert [s.rank for s in plan.schedule(8)][:2] == [s.rank for s in before]


def test_node_faults_are_injected_by_their_node_apart_from_the_ranks_draws(tmp_path) -> None:
    with_node = TOML + '\n[[faults]]\nkind = "stop"\nnode = 1\nafter_s = 3\nfor_s = 1\n'
    plan = load(_write(tmp_path, "n.toml", with_node))
    (on,) = plan.on_node(1)
    assert (on.index, on.rank, on.fault.for_s) == (2, NODE, 1.0)
    assert plan.on_node(0) == [] and plan.on_coordinator() == []
    before = load(_write(tmp_path, "p.toml", TOML)).schedule(8)
    ranks = [s.rank for s in plan.schedule(8)]
    assert ranks[:2] == [s.rank for s in before] and ranks[2] == NODE


def test_every_s_faults_are_drawn_from_the_seed_alone(tmp_path) -> None:
    text = "seed = 5\n[[faults]]\nkind = 'kill'\nrank = 'random'\nevery_s = 30\n"
    plan = load(_write(tmp_path, "r.toml", text))
    first = plan.schedule(4)
    assert len(first) == MAX_OCCURRENCES
    assert [(s.rank, s.at_s) for s in first] == [(s.rank, s.at_s) for s in plan.schedule(4)]
    times = [s.at_s or 0.0 for s in first]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert 25 < sum(gaps) / len(gaps) < 35  # the mean time between faults
    assert {s.rank for s in first} == {0, 1, 2, 3}
    other = plan.model_copy(update={"seed": 6}).schedule(4)
    assert [s.at_s for s in other[:5]] != [s.at_s for s in first[:5]]


def test_without_a_plan_no_injector_is_made() -> None:
    assert from_environment({}, group=None) is None  # type: ignore[arg-type]


def _entries(t0: float) -> list[dict]:
    return [{"rank": r, "t": t0 + 0.1, "event": "joined", "world": 4} for r in range(4)] + [
        {"rank": 1, "t": t0 + 2.0, "event": "injected", "fault": 0, "kind": "kill", "step": 20},
        {
            "rank": 3,
            "t": t0 + 2.3,
            "event": "noticed",
            "outcome": "PeerFailed",
            "message": "rank 1 failed: connection closed without goodbye",
        },
        {
            "rank": 0,
            "t": t0 + 2.4,
            "event": "ended",
            "outcome": "PeerFailed",
            "message": "rank 1 failed: its process died (signal 9)",
        },
        {
            "rank": 3,
            "t": t0 + 2.6,
            "event": "ended",
            "outcome": "JobAborted",
            "message": "stopped by the coordinator",
        },
        {"rank": 2, "t": t0 + 3.0, "event": "ended", "outcome": "JobAborted", "message": ""},
    ]


def test_the_verdict_says_when_and_who_noticed(tmp_path) -> None:
    plan = load(_write(tmp_path, "p.toml", TOML))
    outcome = verdict(plan, _entries(100.0), exit_code=1, started=100.0, finished=103.5)
    kill, stop = outcome["faults"]
    assert kill["injected"] and kill["rank"] == 1 and kill["step"] == 20
    assert kill["injected_at_s"] == 2.0 and kill["detected_after_s"] == 0.3
    assert (kill["detected_by"], kill["named_rank"]) == (3, 1)
    assert not stop["injected"]
    assert not outcome["survived"]
    assert "noticed after 0.30 s by rank 3" in table(outcome)
    # the stop never came, so the plan was not tested as written
    assert outcome["expectation"] == "fail within 5 s" and not outcome["held"]
    assert outcome["never_injected"] == [1]
    assert "did NOT hold (fault 1 never injected" in table(outcome)
    assert verdict(_one(plan), _entries(100.0), exit_code=1, started=100.0, finished=103.5)["held"]


def _one(plan: Plan) -> Plan:
    """The plan with its first fault only."""
    return plan.model_copy(update={"faults": plan.faults[:1]})


def test_a_rank_its_agent_stopped_noticed_the_fault(tmp_path) -> None:
    plan = load(_write(tmp_path, "p.toml", TOML))
    entries = [e for e in _entries(100.0) if e.get("event") != "noticed"]
    entries.append(
        {
            "rank": 2,
            "t": 102.1,
            "event": "ended",
            "outcome": "SIGTERM",
            "message": "stopped by SIGTERM",
        }
    )
    kill = verdict(plan, entries, exit_code=1, started=100.0, finished=103.5)["faults"][0]
    assert (kill["detected_by"], kill["detected_after_s"]) == (2, 0.1)
    assert kill["error"] == "SIGTERM: stopped by SIGTERM"


def test_an_expectation_that_failed_is_said(tmp_path) -> None:
    plan = _one(
        load(
            _write(tmp_path, "p.toml", TOML.replace("expect_within_s = 5", "expect_within_s = 0.5"))
        )
    )
    assert verdict(plan, _entries(0.0), exit_code=1, started=0.0, finished=2.4)["held"]
    assert not verdict(plan, _entries(0.0), exit_code=1, started=0.0, finished=3.0)["held"]
    assert not verdict(plan, _entries(0.0), exit_code=0, started=0.0, finished=2.4)["held"]
    survive = plan.model_copy(update={"expect": "survive"})
    assert verdict(survive, _entries(0.0), exit_code=0, started=0.0, finished=9.0)["held"]


def test_a_log_line_cut_short_by_a_kill_is_skipped(tmp_path) -> None:
    log = tmp_path / "chaos.jsonl"
    log.write_text('{"rank": 0, "t": 1, "event": "joined"}\n{"rank": 1, "t": 2, "ev')
    assert read_log(log) == [{"rank": 0, "t": 1, "event": "joined"}]
    assert read_log(tmp_path / "none.jsonl") == []


def test_a_node_fault_is_noticed_by_a_rank_of_another_node(tmp_path) -> None:
    plan = load(
        _write(
            tmp_path,
            "n.toml",
            "expect = 'fail'\nexpect_names = 2\n[[faults]]\nkind = 'kill'\nnode = 1\nafter_s = 2\n",
        )
    )
    entries = [
        {
            "rank": NODE,
            "node": 1,
            "ranks": [2, 3],
            "t": 2.0,
            "event": "injected",
            "fault": 0,
            "kind": "kill",
            "step": None,
        },
        {"rank": 3, "t": 2.05, "event": "ended", "outcome": "SIGTERM", "message": "stopped"},
        {
            "rank": 0,
            "t": 2.2,
            "event": "noticed",
            "outcome": "PeerFailed",
            "message": "rank 2 failed: connection closed without goodbye",
        },
    ]
    outcome = verdict(plan, entries, exit_code=1, started=0.0, finished=4.0)
    (fault,) = outcome["faults"]
    assert fault["rank"] == "node 1" and fault["detected_by"] == 0  # not rank 3, on the node
    assert outcome["expectation"] == "fail, naming rank 2" and outcome["held"]
    assert "fault 0 (kill) on node 1, 2.00 s in: noticed after 0.20 s by rank 0" in table(outcome)
    other = plan.model_copy(update={"expect_names": 3})
    assert not verdict(other, entries, exit_code=1, started=0.0, finished=4.0)["held"]


def test_a_fault_in_a_collective_says_which_and_broken_invariants_fail_the_verdict(
    tmp_path,
) -> None:
    plan = load(_write(tmp_path, "c.toml", "[[faults]]\nkind = 'kill'\nrank = 1\ncollective = 9\n"))
    hit = {
        "rank": 1,
        "t": 1.0,
        "event": "injected",
        "fault": 0,
        "kind": "kill",
        "step": 4,
        "collective": 9,
        "op": "all_reduce",
    }
    states = [
        {
            "rank": r,
            "t": 0.5,
            "event": "state",
            "step": 4,
            "generation": 1,
            "pid": r,
            "key": "whole",
            "digest": f"d{r}",
        }
        for r in range(2)
    ]
    outcome = verdict(plan, [hit, *states], exit_code=0, started=0.0, finished=2.0)
    assert outcome["faults"][0]["collective"] == 9
    text = table(outcome)
    assert "on rank 1 at step 4 in collective 9 (all_reduce)" in text
    assert "invariant replicas agree (0 compared): BROKEN: generation 1, step 4" in text
    assert not outcome["held"]  # no expectation given, but the replicas disagree
    unchecked = verdict(plan, [hit], 0, 0.0, 2.0)
    assert unchecked["held"]  # nothing was checked: nothing failed
    assert unchecked["invariants"]["data_once"]["status"] == "not checked"
    assert "invariant data once: not checked (no rank noted its state" in table(unchecked)


def test_a_relayed_error_is_blamed_on_the_rank_it_began_on_though_its_text_names_none(
    tmp_path,
) -> None:
    from shardwire.protocol.errors import relayed_error
    from shardwire.worker.chaos.inject import _described

    # a rank's own fault, relayed through the node arena: its text is the raising rank's
    relayed = _described(relayed_error("CollectiveError", "fault 0 of the chaos plan", 1))
    assert relayed == {
        "outcome": "CollectiveError",
        "message": "fault 0 of the chaos plan",
        "blamed": 1,
    }
    entries = _entries(100.0)
    entries[5] = {"rank": 3, "t": 102.3, "event": "noticed", **relayed}
    plan = load(_write(tmp_path, "p.toml", TOML))
    kill, _stop = verdict(plan, entries, exit_code=1, started=100.0, finished=103.5)["faults"]
    assert (kill["detected_by"], kill["named_rank"]) == (3, 1)
    # a corrupt frame, found by rank 0 and relayed: its text names the sender, which wins
    corrupt = _described(relayed_error("IntegrityError", "frame from rank 1: bad checksum", 0))
    entries[5] = {"rank": 3, "t": 102.3, "event": "noticed", **corrupt}
    kill, _stop = verdict(plan, entries, exit_code=1, started=100.0, finished=103.5)["faults"]
    assert (corrupt["blamed"], kill["named_rank"]) == (0, 1)
    # a timeout names no rank to blame: the message's own rank stands
    timeout = _described(relayed_error("CollectiveTimeout", "all_reduce #3: rank 2 silent", 0))
    assert "blamed" not in timeout
