"""What each fault of a plan cost the job, from the chaos log and the job's exit (pure).

For every fault: whether and when it was injected (seconds since the job started), on
which rank and at which step; when the job first noticed it (the first other rank that
learned of a failure after it: its peer connection saw it, or the coordinator told it),
which rank that was and whom its error named; and the job's fate. The plan's
expectation is then checked: ``survive`` (the job exited 0) or ``fail`` (it exited
non-zero, and with ``expect_within_s`` it was over within that long of the first fault;
with ``expect_names`` the rank that first noticed the first fault named that rank). The
invariants of :mod:`invariants` hold too, where the ranks noted their state; one with
nothing to compare is listed as not checked, and fails nothing.

A coordinator is not a rank: its fault is not noticed as a failure while it comes back.
For it the verdict says when it was back (the launcher notes when it started it again, or
continued it) and when every rank that lost its connection to it had reconnected (each
rank notes both).
"""

from __future__ import annotations

import re
from typing import Any

from shardwire.worker.chaos import invariants
from shardwire.worker.chaos.invariants import Status
from shardwire.worker.chaos.plan import COORDINATOR, NODE, Plan

_NAMED = re.compile(r"\brank (\d+)\b")


def verdict(
    plan: Plan,
    entries: list[dict[str, Any]],
    exit_code: int,
    started: float,
    finished: float,
    *,
    clean: list[dict[str, Any]] | None = None,
) -> dict:
    """The verdict of a job that ran from ``started`` to ``finished`` (wall clock);
    ``clean``: the chaos log of the same job run without faults (``compare = "clean"``)."""
    hits = sorted((e for e in entries if e.get("event") == "injected"), key=lambda e: e["t"])
    ended = sorted((e for e in entries if e.get("event") == "ended"), key=lambda e: e["t"])
    heard = sorted(
        (e for e in entries if e.get("event") in ("noticed", "ended") and e["outcome"] != "ok"),
        key=lambda e: e["t"],
    )
    # when each generation of processes got going: their first step
    stepped = sorted((e for e in entries if e.get("event") == "stepped"), key=lambda e: e["t"])
    on_coordinator = [h for h in hits if h["rank"] == COORDINATOR]
    faults = []
    for index, fault in enumerate(plan.faults):
        mine = [h for h in hits if h["fault"] == index]
        if not mine:
            faults.append({"fault": index, "kind": fault.kind, "injected": False})
        for hit in mine:
            record = _record(index, fault.kind, hit, heard=heard, stepped=stepped, started=started)
            if hit["rank"] == COORDINATOR:  # until the next fault on it
                until = min((h["t"] for h in on_coordinator if h["t"] > hit["t"]), default=finished)
                record.update(coordinator_return(hit, entries, until))
            faults.append(record)
    outcome: dict[str, Any] = {
        "seed": plan.seed,
        "exit_code": exit_code,
        "survived": exit_code == 0,
        "wall_s": round(finished - started, 3),
        "faults": faults,
        "ranks_ended": {str(e["rank"]): e["outcome"] for e in ended},
        # worker processes the job started in all (a rank's each new process joins)
        "processes": len({e["pid"] for e in entries if e.get("event") == "joined" and "pid" in e}),
    }
    first = hits[0]["t"] if hits else None
    expectation, held = _expectation(plan, first, finished, exit_code)
    if plan.expect_names is not None:  # the first fault's: the first to be injected
        order = sorted((f for f in faults if f["injected"]), key=lambda f: f["injected_at_s"])
        expectation += f", naming rank {plan.expect_names}"
        held = held and bool(order) and order[0].get("named_rank") == plan.expect_names
    checked = invariants.check(entries, plan.check_every, clean)
    missed = [f["fault"] for f in faults if not f["injected"]]
    outcome.update(
        expectation=expectation,
        invariants=checked,
        never_injected=missed,  # an expectation is not tested by a fault that never came
        held=held and not missed and all(c["status"] != Status.BROKEN for c in checked.values()),
    )
    return outcome


def _named(noticed: dict[str, Any]) -> int | None:
    """The rank a noticing rank's error blamed: the first rank its message names (a
    corrupt frame's names the peer that sent it, not the rank that found it), else the
    rank a relayed error began on (a fault raised inside a collective names none)."""
    if named := _NAMED.search(noticed.get("message", "")):
        return int(named.group(1))
    blamed = noticed.get("blamed")
    return blamed if isinstance(blamed, int) else None


def _record(
    index: int,
    kind: str,
    hit: dict[str, Any],
    *,
    heard: list[dict[str, Any]],
    stepped: list[dict[str, Any]],
    started: float,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "fault": index,
        "kind": kind,
        "injected": True,
        "occurrence": hit.get("occurrence", 0),
        "rank": _target(hit),
        "step": hit.get("step"),
        "injected_at_s": round(hit["t"] - started, 3),
    }
    if "collective" in hit:
        record.update(collective=hit["collective"], op=hit["op"])
    hit_ranks = set(hit.get("ranks", [hit["rank"]]))  # a node's: all of its ranks
    noticed = next((e for e in heard if e["t"] >= hit["t"] and e["rank"] not in hit_ranks), None)
    if noticed is not None:
        record.update(
            detected_after_s=round(noticed["t"] - hit["t"], 3),
            detected_by=noticed["rank"],
            named_rank=_named(noticed),
            error=f"{noticed['outcome']}: {noticed.get('message', '')}",
        )
        # restarted: the first step of a later generation, and how far back it resumed
        again = next((e for e in stepped if e["t"] > noticed["t"]), None)
        if again is not None:
            record["recovery_s"] = round(again["t"] - hit["t"], 3)
            if hit.get("step") is not None:
                record["steps_lost"] = max(0, hit["step"] - again["step"] + 1)
    return record


def coordinator_return(
    hit: dict[str, Any], entries: list[dict[str, Any]], until: float
) -> dict[str, Any]:
    """What a fault on the coordinator at ``hit`` cost, up to ``until``: when it was back
    (``back_after_s``, and how), which ranks lost their connection to it (``lost_by``),
    and when every one of them had reconnected (``reconnected_after_s``) or which did not
    (``not_reconnected``). ``while_forming``: no rank had joined yet (they join it once it
    is back, and note nothing lost)."""
    at = hit["t"]
    window = sorted((e for e in entries if at <= e["t"] <= until), key=lambda e: e["t"])
    out: dict[str, Any] = {}
    back = next((e for e in window if e.get("event") == "back" and e["rank"] == COORDINATOR), None)
    if back is not None:
        out.update(back_after_s=round(back["t"] - at, 3), back=back.get("how", "back"))
    lost: dict[int, float] = {}  # rank -> when it lost its connection first
    again: dict[int, float] = {}  # rank -> when it was taken back after that
    for e in window:
        if e.get("event") == "lost_coordinator":
            lost.setdefault(e["rank"], e["t"])
        elif e.get("event") == "rejoined" and e["rank"] in lost:
            again.setdefault(e["rank"], e["t"])
    out["lost_by"] = sorted(lost)
    if not lost and not any(e.get("event") == "joined" and e["t"] <= at for e in entries):
        out["while_forming"] = True
    missing = sorted(set(lost) - set(again))
    if missing:
        out["not_reconnected"] = missing
    elif again:
        out["reconnected_after_s"] = round(max(again.values()) - at, 3)
    return out


def _target(hit: dict[str, Any]) -> int | str:
    """Whom a fault hit: a rank, the coordinator, or a node."""
    if hit["rank"] == COORDINATOR:
        return "coordinator"
    if hit["rank"] == NODE:
        return f"node {hit['node']}"
    return int(hit["rank"])


def _coordinator_line(f: dict[str, Any]) -> str:
    """When the coordinator a fault hit was back, and when the ranks had reconnected."""
    if "back_after_s" in f:
        text = f"back after {f['back_after_s']:.2f} s ({f['back']})"
    else:
        text = "not back before the job ended"
    lost = f.get("lost_by", [])
    if not lost and f.get("while_forming"):
        return text + "; the job was forming: no rank had joined yet"
    if not lost:
        return text + "; no rank lost its connection to it"
    if "not_reconnected" in f:
        missing = ", ".join(map(str, f["not_reconnected"]))
        return text + f"; of the {len(lost)} ranks that lost it, {missing} did not reconnect"
    who = f"all {len(lost)} ranks" if len(lost) > 1 else f"rank {lost[0]}, the one"
    after = f["reconnected_after_s"]
    return text + f"; {who} that lost it reconnected after {after:.2f} s"


def _expectation(
    plan: Plan, first: float | None, finished: float, exit_code: int
) -> tuple[str, bool]:
    if plan.expect is None:
        return "none given", True
    if plan.expect == "survive":
        return "survive", exit_code == 0
    within = plan.expect_within_s
    text = "fail" + (f" within {within:g} s" if within else "")
    if exit_code == 0 or first is None:
        return text, False
    if within is None:
        return text, True
    return text, finished - first <= within


def table(outcome: dict) -> str:
    """The verdict as a few lines for a terminal."""
    lines = [f"chaos verdict (seed {outcome['seed']}), job exit status {outcome['exit_code']}:"]
    for f in outcome["faults"]:
        if not f["injected"]:
            lines.append(f"  fault {f['fault']} ({f['kind']}): never injected")
            continue
        who = f["rank"] if isinstance(f["rank"], str) else f"rank {f['rank']}"
        who = "the coordinator" if who == "coordinator" else who
        where = who + (f" at step {f['step']}" if f["step"] is not None else "")
        if "collective" in f:
            where += f" in collective {f['collective']} ({f['op']})"
        seen = _coordinator_line(f) if f["rank"] == "coordinator" else ""
        if "detected_by" in f:
            noticed = (
                f"noticed after {f['detected_after_s']:.2f} s by rank {f['detected_by']}"
                f" ({f['error'][:120]})"
            )
            seen = f"{seen}; {noticed}" if seen else noticed
        seen = seen or "not noticed by another rank"
        if "recovery_s" in f:
            seen += f"; training again after {f['recovery_s']:.2f} s"
        lines.append(
            f"  fault {f['fault']} ({f['kind']}) on {where}, {f['injected_at_s']:.2f} s in: {seen}"
        )
    for name, result in outcome["invariants"].items():
        named = name.replace("_", " ")
        if result["status"] == Status.NOT_CHECKED:
            lines.append(f"  invariant {named}: not checked ({result['why']})")
            continue
        state = "held" if result["status"] == Status.HELD else f"BROKEN: {result['breach']}"
        lines.append(f"  invariant {named} ({result['compared']} compared): {state}")
    held = "held" if outcome["held"] else "did NOT hold"
    if outcome["never_injected"]:
        faults = ", ".join(map(str, outcome["never_injected"]))
        held += f" (fault {faults} never injected: the job ended first, or no rank reached it)"
    lines.append(f"  expected: {outcome['expectation']}: {held}")
    return "\n".join(lines)
