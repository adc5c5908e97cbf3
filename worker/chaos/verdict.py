"""What each fault of a plan cost the job, from the chaos log and the job's exit (pure).

For every fault: whether and when it was injected (seconds since the job started), on
which rank and at which step; when the job first noticed it (the first other rank that
learned of a failure after it: its peer connection saw it, or the coordinator told it),
which rank that was and whom its error named; and the job's fate. The plan's
expectation is then checked: ``survive`` (the job exited 0) or ``fail`` (it exited
non-zero, and with ``expect_within_s`` it was over within that long of the first fault).
"""

from __future__ import annotations

import re
from typing import Any

from shardwire.worker.chaos.plan import COORDINATOR, Plan

_NAMED = re.compile(r"\brank (\d+)\b")


def verdict(
    plan: Plan, entries: list[dict[str, Any]], exit_code: int, started: float, finished: float
) -> dict:
    """The verdict of a job that ran from ``started`` to ``finished`` (wall clock)."""
    injected = {e["fault"]: e for e in entries if e.get("event") == "injected"}
    ended = sorted((e for e in entries if e.get("event") == "ended"), key=lambda e: e["t"])
    heard = sorted(
        (e for e in entries if e.get("event") in ("noticed", "ended") and e["outcome"] != "ok"),
        key=lambda e: e["t"],
    )
    faults = []
    for index, fault in enumerate(plan.faults):
        record: dict[str, Any] = {"fault": index, "kind": fault.kind, "injected": False}
        hit = injected.get(index)
        if hit is not None:
            record.update(
                injected=True,
                rank=hit["rank"] if hit["rank"] != COORDINATOR else "coordinator",
                step=hit.get("step"),
                injected_at_s=round(hit["t"] - started, 3),
            )
            noticed = next(
                (e for e in heard if e["t"] >= hit["t"] and e["rank"] != hit["rank"]), None
            )
            if noticed is not None:
                named = _NAMED.search(noticed.get("message", ""))
                record.update(
                    detected_after_s=round(noticed["t"] - hit["t"], 3),
                    detected_by=noticed["rank"],
                    named_rank=int(named.group(1)) if named else None,
                    error=f"{noticed['outcome']}: {noticed.get('message', '')}",
                )
        faults.append(record)
    outcome = {
        "seed": plan.seed,
        "exit_code": exit_code,
        "survived": exit_code == 0,
        "wall_s": round(finished - started, 3),
        "faults": faults,
        "ranks_ended": {str(e["rank"]): e["outcome"] for e in ended},
    }
    outcome["expectation"], outcome["held"] = _expectation(plan, injected, finished, exit_code)
    return outcome


def _expectation(
    plan: Plan, injected: dict[int, dict], finished: float, exit_code: int
) -> tuple[str, bool]:
    if plan.expect is None:
        return "none given", True
    if plan.expect == "survive":
        return "survive", exit_code == 0
    within = plan.expect_within_s
    text = "fail" + (f" within {within:g} s" if within else "")
    if exit_code == 0 or not injected:
        return text, False
    if within is None:
        return text, True
    first = min(e["t"] for e in injected.values())
    return text, finished - first <= within


def table(outcome: dict) -> str:
    """The verdict as a few lines for a terminal."""
    lines = [f"chaos verdict (seed {outcome['seed']}), job exit status {outcome['exit_code']}:"]
    for f in outcome["faults"]:
        if not f["injected"]:
            lines.append(f"  fault {f['fault']} ({f['kind']}): never injected")
            continue
        who = "the coordinator" if f["rank"] == "coordinator" else f"rank {f['rank']}"
        where = who + (f" at step {f['step']}" if f["step"] is not None else "")
        seen = "not noticed by another rank"
        if "detected_by" in f:
            seen = (
                f"noticed after {f['detected_after_s']:.2f} s by rank {f['detected_by']}"
                f" ({f['error'][:120]})"
            )
        lines.append(
            f"  fault {f['fault']} ({f['kind']}) on {where}, {f['injected_at_s']:.2f} s in: {seen}"
        )
    held = "held" if outcome["held"] else "did NOT hold"
    lines.append(f"  expected: {outcome['expectation']}: {held}")
    return "\n".join(lines)
