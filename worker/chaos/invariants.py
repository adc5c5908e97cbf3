"""What must hold of a run through faults, checked from the ranks' state notes (pure).

Where a script hands the run log what each rank read in a step and what it holds
(``log.step(..., read=batch, held=...)``), a rank under a plan notes, every
``check_every`` steps, the step, its generation, a digest of what it holds (with the
key of the ranks that must hold the same bytes), a fingerprint of what it read, and
the loss. From those notes:

- **replicas agree**: in each generation, at each step, the ranks of one key (replicas
  of the same shard) hold the same bytes;
- **steps in order**: each process's steps only go forward within a generation, and a
  generation never starts past the newest step an earlier one finished (nothing skipped);
- **data once**: however often a rank ran a step (again, after a roll-back), it read the
  same samples: none skipped, none seen twice;
- **as clean** (``compare = "clean"``): every step's digest, samples and loss, and the
  final loss, equal a fault-free run's of the same command.

Each invariant ends in one of three states (:class:`Status`): it held over what it
compared, it broke (with the first breach), or it was not checked because the notes held
nothing to compare (with why): a run whose ranks each hold a shard of their own has no
replicas to compare, and one that never ran a step twice has no second reading of it.
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum
from typing import Any

State = dict[str, Any]


class Status(StrEnum):
    """How an invariant came out (its JSON ``status``)."""

    HELD = "held"  # it held over everything it compared
    BROKEN = "broken"  # a breach: the verdict fails
    NOT_CHECKED = "not checked"  # nothing to compare (``why`` says so): neither held nor broken


def notes(entries: list[dict[str, Any]]) -> list[State]:
    """The state notes of a chaos log, in time order."""
    return sorted((e for e in entries if e.get("event") == "state"), key=lambda e: e["t"])


def check(
    entries: list[dict[str, Any]], check_every: int, clean: list[dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Each invariant: its status, how much it compared, and the first breach (or why
    it was not checked)."""
    names = ["replicas_agree", "steps_in_order", "data_once"]
    names += [] if clean is None else ["as_clean"]
    states = notes(entries)
    if not states:
        why = (
            "check_every = 0: the ranks noted no state"
            if check_every == 0
            else "no rank noted its state: the script handed the run log no read= or held="
        )
        return {name: _result(0, unchecked=why) for name in names}
    out = {
        "replicas_agree": _replicas(states),
        "steps_in_order": _order(states, check_every),
        "data_once": _data(states),
    }
    if clean is not None:
        out["as_clean"] = _as_clean(states, notes(clean))
    return out


def _result(compared: int, breach: str | None = None, *, unchecked: str = "") -> dict[str, Any]:
    """An invariant's outcome; ``unchecked``: why it was not checked, if it compared nothing."""
    if breach is not None:
        return {"status": Status.BROKEN, "compared": compared, "breach": breach}
    if compared == 0:
        return {"status": Status.NOT_CHECKED, "compared": 0, "why": unchecked}
    return {"status": Status.HELD, "compared": compared}


def _replicas(states: list[State]) -> dict[str, Any]:
    held: dict[tuple[int, int, str], dict[int, str]] = defaultdict(dict)
    for s in states:
        if "digest" in s:
            held[(s["generation"], s["step"], s["key"])][s["rank"]] = s["digest"]
    compared = 0  # steps at which two or more ranks held one key
    for (generation, step, key), digests in sorted(held.items()):
        if len(set(digests.values())) > 1:
            ranks = sorted(digests)
            return _result(
                compared,
                f"generation {generation}, step {step}: ranks {ranks} of {key} hold "
                "different bytes",
            )
        compared += len(digests) > 1
    if not held:
        return _result(0, unchecked="the script handed the run log no held=")
    why = (
        "no two ranks held the same key at a step: each holds a shard of its own, as under "
        "FULL_SHARD"
    )
    return _result(compared, unchecked=why)


def _order(states: list[State], check_every: int) -> dict[str, Any]:
    last: dict[tuple[int, int], int] = {}  # (pid, generation) -> its newest step
    seen: set[int] = set()  # the generations started so far
    finished = 0  # the newest step any rank noted before
    for s in states:
        here = (s["pid"] if "pid" in s else s["rank"], s["generation"])
        if here in last and s["step"] <= last[here]:
            return _result(
                len(last),
                f"rank {s['rank']} noted step {s['step']} after step {last[here]} "
                f"in generation {s['generation']}",
            )
        if s["generation"] not in seen:
            seen.add(s["generation"])
            if s["step"] > finished + check_every:
                return _result(
                    len(last),
                    f"generation {s['generation']} started at step {s['step']}, past step "
                    f"{finished}, the newest any rank had finished",
                )
        last[here] = s["step"]
        finished = max(finished, s["step"])
    return _result(len(last), unchecked="no rank noted a step")


def _data(states: list[State]) -> dict[str, Any]:
    read: dict[tuple[int, int], str] = {}
    again = 0  # steps a rank ran again (after a roll-back), held to their first reading
    for s in states:
        if "read" not in s:
            continue
        where = (s["rank"], s["step"])
        if where in read:
            again += 1
            if read[where] != s["read"]:
                return _result(
                    again,
                    f"rank {s['rank']} read other samples at step {s['step']} when it ran "
                    f"the step again (generation {s['generation']})",
                )
        read[where] = s["read"]
    if not read:
        return _result(0, unchecked="the script handed the run log no read=")
    return _result(again, unchecked="no step ran again: no second reading to compare")


def _as_clean(states: list[State], clean: list[State]) -> dict[str, Any]:
    if not clean:
        return _result(0, "the clean run noted no state")
    want = {(s["rank"], s["step"]): s for s in clean}
    compared = 0
    for s in states:
        other = want.get((s["rank"], s["step"]))
        if other is None:
            continue
        for field in ("digest", "read", "loss"):
            if s.get(field) != other.get(field):
                return _result(
                    compared,
                    f"rank {s['rank']}, step {s['step']} (generation {s['generation']}): "
                    f"its {field} differs from the clean run's",
                )
        compared += 1
    (step, final), (clean_step, final_clean) = _final(states), _final(clean)
    if step != clean_step:
        return _result(compared, f"the run ended at step {step}, the clean run at {clean_step}")
    if final != final_clean:
        return _result(compared, f"final loss {final} against the clean run's {final_clean}")
    return _result(compared, unchecked="no step of this run was noted in the clean run")


def _final(states: list[State]) -> tuple[int, float | None]:
    """Rank 0's newest step, and its loss there."""
    mine = [s for s in states if s["rank"] == 0]
    if not mine:
        return 0, None
    last = max(mine, key=lambda s: (s["step"], s["t"]))
    return last["step"], last.get("loss")
