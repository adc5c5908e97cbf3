"""The invariants of a run through faults, judged from state notes (pure): replicas
agree, steps go forward and skip nothing, each step reads the same samples however often
it runs, and a run held to a clean one equals it step by step. One with nothing to
compare is not checked, and says why, rather than held."""

from __future__ import annotations

from typing import Any

from shardwire.worker.chaos.invariants import Status, check


def _note(rank: int, step: int, t: float, **more: Any) -> dict[str, Any]:
    base = {
        "event": "state",
        "rank": rank,
        "step": step,
        "t": t,
        "generation": 1,
        "pid": 100 + rank,
    }
    return {**base, "read": f"r{rank}-{step}", "key": "whole", "digest": f"d{step}", **more}


def _run(steps: int = 4, ranks: int = 2) -> list[dict[str, Any]]:
    return [
        _note(r, s, s + r / 10, loss=1.0 / s) for s in range(1, steps + 1) for r in range(ranks)
    ]


def test_a_clean_run_holds_every_invariant_and_equals_itself() -> None:
    again = [_note(r, 4, 20.0 + r, generation=2, pid=200 + r, loss=0.25) for r in range(2)]
    result = check([*_run(), *again], 1, clean=[*_run(), *again])
    assert {name: r["status"] for name, r in result.items()} == {
        "replicas_agree": "held",
        "steps_in_order": "held",
        "data_once": "held",
        "as_clean": "held",
    }
    assert result["replicas_agree"]["compared"] == 5 and result["as_clean"]["compared"] == 10
    assert result["data_once"]["compared"] == 2  # step 4, run again by both ranks


def test_without_state_notes_every_invariant_is_not_checked_and_says_why() -> None:
    joined = [{"event": "joined", "rank": 0, "t": 0.0}]
    result = check(joined, 1, clean=[])
    assert set(result) == {"replicas_agree", "steps_in_order", "data_once", "as_clean"}
    assert {r["status"] for r in result.values()} == {Status.NOT_CHECKED}
    assert all(
        "the script handed the run log no read= or held=" in r["why"] for r in result.values()
    )
    assert check(joined, 0)["data_once"]["why"] == "check_every = 0: the ranks noted no state"


def test_a_run_that_never_ran_a_step_again_did_not_check_data_once() -> None:
    result = check(_run(), 1)["data_once"]
    assert result == {
        "status": "not checked",
        "compared": 0,
        "why": "no step ran again: no second reading to compare",
    }
    unread = [{k: v for k, v in n.items() if k != "read"} for n in _run()]
    assert check(unread, 1)["data_once"]["why"] == "the script handed the run log no read="


def test_replicas_that_hold_different_bytes_are_named() -> None:
    notes = _run()
    notes[3]["digest"] = "other"  # rank 1 at step 2
    result = check(notes, 1)["replicas_agree"]
    assert result["status"] == Status.BROKEN
    assert result["breach"] == "generation 1, step 2: ranks [0, 1] of whole hold different bytes"


def test_shards_of_different_keys_are_not_compared_so_replicas_agree_is_not_checked() -> None:
    notes = _run()
    for n in notes:
        n["key"], n["digest"] = f"shard {n['rank']}/2", f"{n['digest']}-{n['rank']}"
    result = check(notes, 1)["replicas_agree"]
    assert result["status"] == Status.NOT_CHECKED and result["compared"] == 0
    assert "each holds a shard of its own, as under FULL_SHARD" in result["why"]
    unheld = [{k: v for k, v in n.items() if k not in ("key", "digest")} for n in notes]
    assert check(unheld, 1)["replicas_agree"]["why"] == "the script handed the run log no held="


def test_a_step_noted_twice_by_one_process_is_out_of_order() -> None:
    notes = [*_run(3), _note(0, 2, 9.0)]
    result = check(notes, 1)["steps_in_order"]
    assert result["status"] == Status.BROKEN
    assert "rank 0 noted step 2 after step 3" in result["breach"]


def test_a_generation_that_starts_past_the_newest_finished_step_skipped_steps() -> None:
    later = [_note(r, 6, 20.0 + r, generation=2, pid=200 + r) for r in range(2)]
    result = check([*_run(3), *later], 1)["steps_in_order"]
    assert result["status"] == Status.BROKEN
    assert (
        result["breach"]
        == "generation 2 started at step 6, past step 3, the newest any rank had finished"
    )
    # a roll-back (steps run again) is in order, and with notes every 2 steps a gap of 2 too
    again = [_note(r, 2, 20.0 + r, generation=2, pid=200 + r) for r in range(2)]
    assert check([*_run(3), *again], 1)["steps_in_order"]["status"] == Status.HELD
    gap = [dict(n, step=5) for n in later]
    assert check([*_run(3), *gap], 2)["steps_in_order"]["status"] == Status.HELD


def test_a_step_run_again_on_other_samples_breaks_data_once() -> None:
    again = [_note(r, 2, 20.0 + r, generation=2, pid=200 + r) for r in range(2)]
    assert check([*_run(3), *again], 1)["data_once"] == {"status": "held", "compared": 2}
    again[1]["read"] = "elsewhere"
    result = check([*_run(3), *again], 1)["data_once"]
    assert result["status"] == Status.BROKEN
    assert "rank 1 read other samples at step 2" in result["breach"]


def test_a_run_held_to_a_clean_one_names_the_first_difference() -> None:
    faulty = _run()
    faulty[5]["digest"] = "drift"  # rank 1, step 3
    faulty[4]["digest"] = faulty[5]["digest"]  # replicas agree with each other
    result = check(faulty, 1, clean=_run())["as_clean"]
    assert result["status"] == Status.BROKEN
    assert result["breach"].startswith("rank 0, step 3 (generation 1): its digest differs")
    shorter = check(_run(3), 1, clean=_run(4))["as_clean"]
    assert shorter["breach"] == "the run ended at step 3, the clean run at 4"
    other_loss = [dict(n, loss=n["loss"] + (n["step"] == 4)) for n in _run()]
    clean_lossless = [{k: v for k, v in n.items() if k != "loss"} for n in _run()]
    assert check(other_loss, 1, clean=_run())["as_clean"]["status"] == Status.BROKEN
    assert check(_run(), 1, clean=clean_lossless)["as_clean"]["status"] == Status.BROKEN
    assert check(_run(), 1, clean=[])["as_clean"]["breach"] == "the clean run noted no state"
