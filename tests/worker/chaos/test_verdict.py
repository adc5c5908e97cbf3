"""The verdict says what it checked: a fault on the coordinator reports when it was back
and when the ranks that lost it had reconnected, from the notes of the launcher and the
ranks; an invariant with nothing to compare is listed as not checked, not as held."""

from __future__ import annotations

import json
from typing import Any

from shardwire.worker.chaos.faultlog import read_log
from shardwire.worker.chaos.inject import Injector
from shardwire.worker.chaos.plan import COORDINATOR, Plan
from shardwire.worker.chaos.supervise import note_coordinator_back
from shardwire.worker.chaos.verdict import table, verdict
from shardwire.worker.collectives.process import ProcessGroup
from tests.worker.transport.fabric import memory_world

KILL = Plan.model_validate(
    {"expect": "survive", "faults": [{"kind": "kill", "rank": "coordinator", "after_s": 4}]}
)


def _hit(t: float, fault: int = 0, kind: str = "kill") -> dict[str, Any]:
    return {
        "rank": COORDINATOR,
        "t": t,
        "event": "injected",
        "fault": fault,
        "kind": kind,
        "step": None,
    }


def _away(rank: int, lost: float, back: float | None) -> list[dict[str, Any]]:
    notes = [{"rank": rank, "t": lost, "event": "lost_coordinator"}]
    return notes + ([] if back is None else [{"rank": rank, "t": back, "event": "rejoined"}])


def _back(t: float, how: str = "started again") -> dict[str, Any]:
    return {"rank": COORDINATOR, "t": t, "event": "back", "how": how, "pid": 99}


def test_a_killed_coordinator_says_when_it_was_back_and_every_rank_had_reconnected() -> None:
    entries = [_hit(4.0), *_away(0, 4.01, 4.7), *_away(1, 4.02, 4.9), _back(4.5)]
    outcome = verdict(KILL, entries, exit_code=0, started=0.0, finished=9.0)
    (fault,) = outcome["faults"]
    assert (fault["back_after_s"], fault["back"]) == (0.5, "started again")
    assert fault["lost_by"] == [0, 1] and fault["reconnected_after_s"] == 0.9
    assert "not_reconnected" not in fault and outcome["held"]
    assert (
        "fault 0 (kill) on the coordinator, 4.00 s in: back after 0.50 s (started again); "
        "all 2 ranks that lost it reconnected after 0.90 s"
    ) in table(outcome)
    assert "not noticed" not in table(outcome)


def test_a_rank_that_never_reconnected_is_named() -> None:
    entries = [_hit(4.0), *_away(0, 4.01, 4.7), *_away(1, 4.02, None), _back(4.5)]
    outcome = verdict(KILL, entries, exit_code=0, started=0.0, finished=9.0)
    (fault,) = outcome["faults"]
    assert fault["not_reconnected"] == [1] and "reconnected_after_s" not in fault
    assert "of the 2 ranks that lost it, 1 did not reconnect" in table(outcome)


def test_a_coordinator_never_back_and_one_no_rank_lost_say_so() -> None:
    gone = verdict(KILL, [_hit(4.0), *_away(0, 4.01, None)], 1, 0.0, 9.0)
    (fault,) = gone["faults"]
    assert "back_after_s" not in fault and fault["not_reconnected"] == [0]
    assert "not back before the job ended" in table(gone)
    joined = {"rank": 0, "t": 1.0, "event": "joined", "world": 1}
    stop = verdict(KILL, [joined, _hit(4.0, kind="stop"), _back(5.0, "continued")], 0, 0.0, 9.0)
    assert "back after 1.00 s (continued); no rank lost its connection to it" in table(stop)


def test_a_coordinator_killed_while_the_job_formed_says_no_rank_had_joined() -> None:
    joined = [{"rank": r, "t": 6.0, "event": "joined", "world": 2} for r in range(2)]
    outcome = verdict(KILL, [_hit(4.0), _back(4.5), *joined], 0, 0.0, 9.0)
    (fault,) = outcome["faults"]
    assert fault["while_forming"] and fault["lost_by"] == []
    assert "back after 0.50 s (started again); the job was forming: no rank had joined yet" in (
        table(outcome)
    )
    early = [dict(e, t=3.0) for e in joined]  # joined before: running, yet none lost it
    (running,) = verdict(KILL, [_hit(4.0), _back(4.5), *early], 0, 0.0, 9.0)["faults"]
    assert "while_forming" not in running


def test_each_coordinator_fault_is_judged_up_to_the_next() -> None:
    plan = Plan.model_validate(
        {"faults": [{"kind": "kill", "rank": "coordinator", "after_s": s} for s in (4, 10)]}
    )
    entries = [
        _hit(4.0),
        *_away(0, 4.01, 4.8),
        _back(4.5),
        _hit(10.0, fault=1),
        *_away(0, 10.01, 10.9),
        _back(10.6),
    ]
    first, second = verdict(plan, entries, 0, 0.0, 20.0)["faults"]
    assert (first["back_after_s"], first["reconnected_after_s"]) == (0.5, 0.8)
    assert (second["back_after_s"], second["reconnected_after_s"]) == (0.6, 0.9)


async def test_the_notes_of_the_launcher_and_the_ranks_reach_the_verdict(tmp_path) -> None:
    """What the launcher and the ranks' injectors write is what the verdict reads."""
    plan = tmp_path / "plan.toml"
    plan.write_text('[[faults]]\nkind = "kill"\nrank = "coordinator"\nafter_s = 4\n')
    log = tmp_path / "chaos.jsonl"
    environ = {"SHARDWIRE_CHAOS": str(plan), "SHARDWIRE_CHAOS_LOG": str(log)}
    log.write_text(json.dumps(_hit(4.0)) + "\n")
    async with memory_world(2) as transports:
        groups = [
            ProcessGroup(t, local_rank=r, local_world_size=2, node_rank=0, generation=1)
            for r, t in enumerate(transports)
        ]
        injectors = [Injector(KILL, group, log) for group in groups]
        for rank, injector in enumerate(injectors):
            injector.coordinator(away=True, at=4.01 + rank / 100)
        note_coordinator_back(environ, 1234, "started again")
        note_coordinator_back({**environ, "SHARDWIRE_CHAOS_CLEAN": "1"}, 1234, "started again")
        note_coordinator_back({}, 1234, "started again")  # no plan: nothing noted
        for rank, injector in enumerate(injectors):
            injector.coordinator(away=False, at=4.7 + rank / 10)
    entries = read_log(log)
    (back,) = [e for e in entries if e["event"] == "back"]
    assert (back["pid"], back["rank"]) == (1234, COORDINATOR)
    back["t"] = 4.5  # the launcher notes the time of its writing: put it 0.5 s in
    (fault,) = verdict(KILL, entries, 0, 0.0, 9.0)["faults"]
    assert fault["back_after_s"] == 0.5 and fault["lost_by"] == [0, 1]
    assert fault["reconnected_after_s"] == 0.8


def test_an_invariant_with_nothing_to_compare_is_listed_as_not_checked() -> None:
    """Under FULL_SHARD no two ranks hold one key, and a run that never ran a step again
    has no second reading: both are not checked, neither held nor broken."""
    states = [
        {
            "rank": r,
            "t": s + r / 10,
            "event": "state",
            "step": s,
            "generation": 1,
            "pid": r,
            "key": f"shard {r}/2",
            "digest": f"d{s}-{r}",
            "read": f"r{r}-{s}",
        }
        for s in (1, 2)
        for r in (0, 1)
    ]
    outcome = verdict(KILL, [_hit(4.0), *states], 0, 0.0, 9.0)
    checks = json.loads(json.dumps(outcome))["invariants"]
    assert {name: c["status"] for name, c in checks.items()} == {
        "replicas_agree": "not checked",
        "steps_in_order": "held",
        "data_once": "not checked",
    }
    assert outcome["held"]  # nothing broken, the expectation held
    text = table(outcome)
    assert "invariant replicas agree: not checked (no two ranks held the same key" in text
    assert "invariant data once: not checked (no step ran again" in text
    assert "invariant steps in order (2 compared): held" in text
    assert "replicas agree (0 compared)" not in text
