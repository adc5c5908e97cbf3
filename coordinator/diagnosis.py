"""Naming the culprit of a hang from every rank's flight recorder (pure).

Theory of operation: a rank that gives up on a collective reports it with its recorder
tail. The coordinator asks every other live rank for its tail and current stack (they
answer from their control threads, so a blocked rank answers too) and, once all have
answered or the inquest's deadline passed, compares them: the ranks of that call's group
whose tails hold no entry for it *never entered* it, and their stacks say where they are
instead. Ranks that did not answer are named as such. The verdict is one line for logs
and summaries ("rank 3 never entered all_reduce #57 (ranks 0-2 waited 30 s); rank 3 is
at train.py:88 in load_batch") plus the culprits' stacks. Absent ranks at the same place
share a line and a stack, so the verdict stays short however many ranks are absent;
messages clip what is still too long. The whole of it (every rank's place, stack and
recorder tail) is :attr:`Verdict.detail`, which the coordinator writes to a file that
the verdict names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwire.protocol.messages import CollectiveRecord, Diagnosis
from shardwire.protocol.ranks import from_runs

_STACKS = 8000  # characters of culprits' stacks kept (an Abort carries at most 8192)
_PLACES = 8  # distinct places of absent ranks named (ranks at one place share a line)


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"ranks 0-2, 5"``; one rank -> ``"rank 3"``."""
    runs: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _call_name(rec: CollectiveRecord) -> str:
    group = "" if rec.group == 0 else f" on group {rec.group}"
    return f"{rec.op} #{rec.seq}{group}"


def _stuck(diagnosis: Diagnosis) -> CollectiveRecord | None:
    """The call a reporting rank gave up on: its newest one that did not end ``ok``."""
    for rec in reversed(diagnosis.collectives):
        if rec.outcome != "ok":
            return rec
    return None


def _entered(diagnosis: Diagnosis, rec: CollectiveRecord) -> bool:
    return any(r.group == rec.group and r.seq == rec.seq for r in diagnosis.collectives)


def _last_on_group(diagnosis: Diagnosis, group: int) -> CollectiveRecord | None:
    mine = [r for r in diagnosis.collectives if r.group == group]
    return mine[-1] if mine else None


def _members(rec: CollectiveRecord, reports: dict[int, Diagnosis], world_size: int) -> list[int]:
    """The ranks of ``rec``'s group: listed, as runs, the world, or (an irregular group
    too large to list) the ranks whose recorders know the group."""
    if rec.ranks:
        return list(rec.ranks)
    if rec.runs:
        return from_runs(rec.runs)
    if rec.size in (0, world_size):
        return list(range(world_size))
    return sorted(r for r, d in reports.items() if any(c.group == rec.group for c in d.collectives))


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int  # the rank blamed
    reason: str
    stacks: str  # the culprits' stacks
    # everything the inquest learnt, for a file: every absent rank's place and stack,
    # every rank's recorder tail (the reason and stacks above are summaries)
    detail: dict = field(default_factory=dict)


def _record(rec: CollectiveRecord) -> dict:
    return rec.model_dump(mode="json", exclude_defaults=True)


def _detail(
    reporter: int,
    reason: str,
    reports: dict[int, Diagnosis],
    world_size: int,
    call: tuple[CollectiveRecord, list[int], list[int], list[int]] | None,
) -> dict:
    """The whole inquest as JSON-ready data: who reported what, the call (with the ranks
    that entered it, never did, or did not answer), and for each rank that answered where
    it was, its stack and its recorder tail."""
    out: dict = {"reporter": reporter, "reason": reason, "world_size": world_size}
    if call is not None:
        stuck, entered, absent, silent = call
        out["call"] = {"name": _call_name(stuck), **_record(stuck)}
        out.update(entered=entered, absent=absent, silent=silent)
    out["ranks"] = {
        str(rank): {
            "where": d.where,
            "stack": d.stack,
            "collectives": [_record(c) for c in d.collectives],
        }
        for rank, d in sorted(reports.items())
    }
    return out


def explain(reporter: int, reason: str, reports: dict[int, Diagnosis], world_size: int) -> Verdict:
    """The verdict for a timed-out collective, from the ranks' diagnoses."""
    mine = reports.get(reporter)
    stuck = _stuck(mine) if mine is not None else None
    if stuck is None:
        return Verdict(reporter, reason, "", _detail(reporter, reason, reports, world_size, None))
    members = _members(stuck, reports, world_size)
    waited = [r for r in members if r in reports and _entered(reports[r], stuck)]
    absent = [r for r in members if r in reports and not _entered(reports[r], stuck)]
    silent = [r for r in members if r not in reports]
    whole = _detail(reporter, reason, reports, world_size, (stuck, waited, absent, silent))
    name = _call_name(stuck)
    if not absent and not silent:
        return Verdict(reporter, f"{reason}; every rank of the group entered {name}", "", whole)
    longest = max(
        (rec.duration_s or rec.age_s)
        for r in waited
        for rec in reports[r].collectives
        if rec.group == stuck.group and rec.seq == stuck.seq
    )
    parts = []
    if absent:
        parts.append(f"{ranks_text(absent)} never entered {name}")
    if silent:
        parts.append(f"{ranks_text(silent)} did not answer")
    text = " and ".join(parts) + f" ({ranks_text(waited)} waited {longest:.0f} s)"
    places: dict[str, list[int]] = {}  # where the absent ranks are, grouped: one line each
    for r in absent:
        report = reports[r]
        last = _last_on_group(report, stuck.group)
        after = f", after {_call_name(last)} ({last.outcome})" if last is not None else ""
        places.setdefault(f"{report.where or 'an unknown place'}{after}", []).append(r)
    stacks = []
    for place, ranks in list(places.items())[:_PLACES]:
        text += f"; {ranks_text(ranks)} {'is' if len(ranks) == 1 else 'are'} at {place}"
        stacks.append(f"--- {ranks_text(ranks)} ---\n{reports[ranks[0]].stack.rstrip()}\n")
    if len(places) > _PLACES:
        text += f"; and {len(places) - _PLACES} more places"
    return Verdict((absent or silent)[0], text, "".join(stacks)[-_STACKS:], whole)


@dataclass
class Inquest:
    """Diagnoses collected for one timed-out collective until all asked have answered."""

    reporter: int
    reason: str
    deadline: float
    asked: set[int] = field(default_factory=set)
    reports: dict[int, Diagnosis] = field(default_factory=dict)

    def add(self, rank: int, diagnosis: Diagnosis | None) -> None:
        """A rank's answer; ``None`` when it has none (it failed or went away)."""
        if diagnosis is not None:
            self.reports[rank] = diagnosis
        self.asked.discard(rank)

    def complete(self, now: float) -> bool:
        return not self.asked or now >= self.deadline

    def verdict(self, world_size: int) -> Verdict:
        return explain(self.reporter, self.reason, self.reports, world_size)
