"""Hang inquests and stall notices in the rendezvous, and the verdict text (pure)."""

from __future__ import annotations

import json

from shardwire.coordinator import JobState, Notice, Send
from shardwire.coordinator.diagnosis import explain, ranks_text
from shardwire.protocol.messages import (
    Abort,
    CollectiveRecord,
    DiagnoseReply,
    DiagnoseRequest,
    Diagnosis,
    Failure,
    Heartbeat,
)

from .test_rendezvous import _running


def rec(seq: int, outcome: str = "ok", *, op: str = "all_reduce", ranks=(0, 1, 2), age=1.0):
    return CollectiveRecord(
        group=0,
        size=len(ranks),
        ranks=list(ranks),
        op=op,
        seq=seq,
        age_s=age,
        duration_s=None if outcome == "running" else age,
        outcome=outcome,
    )


def diag(*records: CollectiveRecord, where: str = "", stack: str = "") -> Diagnosis:
    return Diagnosis(collectives=list(records), where=where, stack=stack)


def test_ranks_text_folds_runs() -> None:
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([2, 0, 1, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_verdict_names_the_rank_that_never_entered_and_where_it_is() -> None:
    reports = {
        0: diag(rec(56), rec(57, "timeout", age=30.2)),
        1: diag(rec(56), rec(57, "running", age=29.9)),
        2: diag(rec(56), where="train.py:88 in load_batch", stack="  File train.py ...\n"),
    }
    verdict = explain(0, "raised CollectiveTimeout: ...", reports, world_size=3)
    assert verdict.rank == 2
    assert verdict.reason == (
        "rank 2 never entered all_reduce #57 (ranks 0-1 waited 30 s); "
        "rank 2 is at train.py:88 in load_batch, after all_reduce #56 (ok)"
    )
    assert verdict.stacks == "--- rank 2 ---\n  File train.py ...\n"


def test_a_verdict_over_many_absent_ranks_groups_them_by_place_and_fits_an_abort() -> None:
    world = 1000
    waiting = rec(7, "timeout", ranks=range(world), age=30)
    reports = {0: diag(rec(6, ranks=range(world)), waiting)}
    for r in range(1, world):  # 999 absent, at 12 places
        where = f"train.py:{100 + r % 12} in load_batch"
        reports[r] = diag(rec(6, ranks=range(world)), where=where, stack=f"  File {where}\n")
    verdict = explain(0, "timeout", reports, world_size=world)
    assert verdict.reason.startswith("ranks 1-999 never entered all_reduce #7 (rank 0 waited")
    assert "; ranks 1, 13, 25," in verdict.reason and "; and 4 more places" in verdict.reason
    assert verdict.reason.count(" are at train.py:") == 8
    assert verdict.stacks.count("--- ranks ") == 8
    abort = Abort(rank=verdict.rank, reason=verdict.reason, stacks=verdict.stacks)
    assert len(abort.reason) <= 4096 and abort.reason.startswith("ranks 1-999 never entered")


def test_a_large_group_named_by_runs_blames_only_its_own_members() -> None:
    world, lane = 1024, range(1, 1024, 4)  # local rank 1 of every 4-rank node
    big = dict(ranks=[], op="all_gather")

    def rec_of(seq: int, outcome: str = "ok") -> CollectiveRecord:
        return rec(seq, outcome, **big).model_copy(
            update={"group": 9, "size": 256, "runs": [(1, 1024, 4)]}
        )

    reports = {r: diag(where="elsewhere.py:1") for r in range(world)}
    for r in lane:
        reports[r] = diag(rec_of(3), rec_of(4, "timeout" if r == 1 else "running"))
    reports[5] = diag(rec_of(3), where="data.py:12 in next_batch")  # the one lane rank late
    verdict = explain(1, "timeout", reports, world_size=world)
    assert verdict.rank == 5
    assert verdict.reason.startswith("rank 5 never entered all_gather #4 on group 9")
    assert "rank 5 is at data.py:12 in next_batch" in verdict.reason


def test_a_reason_too_long_for_its_message_is_cut_in_the_middle_not_refused() -> None:
    text = "head " + "x" * 10_000 + " tail"
    abort = Abort(rank=3, reason=text)
    assert len(abort.reason) == 4096
    assert abort.reason.startswith("head xxx") and abort.reason.endswith("xxx tail")
    cut = int(abort.reason.split(" [... ")[1].split(" ")[0])
    assert len(text) - cut == 4096 - len(f" [... {cut} characters cut ...] ")
    assert Abort(rank=3, reason="short").reason == "short"


def test_verdict_names_ranks_that_did_not_answer() -> None:
    reports = {0: diag(rec(3, "timeout", ranks=(0, 1, 2, 3), age=5)), 1: diag(rec(2))}
    verdict = explain(0, "timeout", reports, world_size=4)
    assert verdict.rank == 1
    assert verdict.reason.startswith(
        "rank 1 never entered all_reduce #3 and ranks 2-3 did not answer (rank 0 waited 5 s)"
    )


def test_verdict_when_everyone_entered_keeps_the_reported_reason() -> None:
    reports = {r: diag(rec(9, "timeout" if r == 0 else "running")) for r in range(3)}
    verdict = explain(0, "all_reduce #9 timed out", reports, world_size=3)
    assert (verdict.rank, verdict.reason) == (
        0,
        "all_reduce #9 timed out; every rank of the group entered all_reduce #9",
    )


def _timeout(rank: int) -> Failure:
    return Failure(
        reason="raised CollectiveTimeout: all_reduce #2 timed out",
        code="collective_timeout",
        diagnosis=diag(rec(1), rec(2, "timeout", age=3)),
    )


def test_a_collective_timeout_asks_every_live_rank_then_aborts_with_the_verdict() -> None:
    r = _running(3)
    actions = r.report_failure(0, _timeout(0), now=10.0)
    assert r.state is JobState.FAILING
    assert {a.conn for a in actions if isinstance(a, Send)} == {1, 2}
    assert all(isinstance(a.msg, DiagnoseRequest) for a in actions)
    assert r.tick(11.0) == []  # still waiting for answers
    assert r.diagnosis(1, DiagnoseReply(diagnosis=diag(rec(1), rec(2, "running"))), 11.5) == []
    here = diag(rec(1), where="train.py:9 in load", stack="stack of rank 2")
    actions = r.diagnosis(2, DiagnoseReply(diagnosis=here), 12.0)
    aborts = {a.conn: a.msg for a in actions if isinstance(a.msg, Abort)}
    assert set(aborts) == {0, 1, 2}
    assert aborts[0].rank == 2 and "stack of rank 2" in aborts[0].stacks
    assert aborts[0].reason.startswith("rank 2 never entered all_reduce #2 (ranks 0-1 waited")
    assert "train.py:9 in load" in aborts[0].reason
    assert (
        r.state is JobState.FAILED and "stack of rank 2" in r.failure.stacks and r.failure.rank == 2
    )


def test_the_verdict_names_a_file_that_holds_every_rank_s_detail() -> None:
    from shardwire.coordinator import Record, Rendezvous, RendezvousConfig

    from .test_rendezvous import join, start

    world = 40
    r = Rendezvous(RendezvousConfig(run_id="job", world_size=world, inquest_dir="/data/inq/"))
    start(r, {c: join(f"n{c:02d}", 0, world=world, lws=1) for c in range(world)})
    everyone = range(world)
    tail = diag(rec(1, ranks=everyone), rec(2, "timeout", ranks=everyone, age=3))
    r.report_failure(0, Failure(reason="timeout", code="collective_timeout", diagnosis=tail), 10.0)
    for c in range(1, world):  # 39 absent, each at a place of its own: the verdict keeps 8
        where = f"train.py:{c} in load"
        here = diag(rec(1, ranks=everyone), where=where, stack=f"stack of rank {c}")
        actions = r.diagnosis(c, DiagnoseReply(diagnosis=here), 11.0)
    (record,) = [a for a in actions if isinstance(a, Record)]
    assert record.path == "/data/inq/job-generation-1-inquest.json"
    abort = next(a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, Abort))
    assert abort.reason.endswith(f"recent collectives: {record.path}")
    assert "; and 31 more places" in abort.reason and abort.stacks.count("--- rank ") == 8
    doc = record.doc
    assert doc["call"]["name"] == "all_reduce #2" and doc["entered"] == [0]
    assert doc["absent"] == list(range(1, world)) and doc["silent"] == []
    assert [doc["ranks"][str(c)]["stack"] for c in range(1, world)] == [
        f"stack of rank {c}" for c in range(1, world)
    ]  # every one, not the verdict's eight
    assert doc["ranks"]["5"]["where"] == "train.py:5 in load"
    assert doc["ranks"]["0"]["collectives"][-1]["outcome"] == "timeout"
    json.dumps(doc)  # a JSON document as it is


def test_without_a_directory_the_verdict_names_no_file() -> None:
    r = _running(3)
    r.report_failure(0, _timeout(0), now=10.0)
    actions = r.tick(13.5)
    abort = next(a.msg for a in actions if isinstance(a.msg, Abort))
    assert "recent collectives:" not in abort.reason
    assert not [a for a in actions if not isinstance(a, Send)]


def test_an_inquest_ends_at_its_deadline_without_every_answer() -> None:
    r = _running(3)
    r.report_failure(0, _timeout(0), now=10.0)
    r.diagnosis(1, DiagnoseReply(diagnosis=diag(rec(1), rec(2, "running"))), 10.5)
    actions = r.tick(13.5)  # diagnose_timeout is 3 s
    abort = next(a.msg for a in actions if isinstance(a.msg, Abort))
    assert abort.rank == 2 and "rank 2 did not answer" in abort.reason


def test_failures_and_disconnects_during_an_inquest_are_testimony() -> None:
    r = _running(3)
    r.report_failure(0, _timeout(0), now=10.0)
    assert r.report_failure(1, _timeout(1), now=10.1) == []  # rank 1 timed out too
    assert r.tick(20.0)[0].msg.rank == 2  # heartbeats are not judged while failing
    r = _running(3)
    r.report_failure(0, _timeout(0), now=10.0)
    r.report_failure(1, _timeout(1), now=10.1)
    actions = r.disconnected(2)
    assert next(a.msg for a in actions if isinstance(a.msg, Abort)).rank == 2


def test_a_busy_loop_is_logged_when_it_starts_and_ends_but_never_fails() -> None:
    r = _running(2)
    busy = Heartbeat(step=4, busy_s=12.0, busy_at="digits.py:33 in load", busy_stack="...")
    started = r.heartbeat(1, busy, now=20.0)
    assert started == [
        Notice(
            "rank 1 busy for 12 s at digits.py:33 in load (its event loop is not running; "
            "heartbeats continue, the job goes on)"
        )
    ]
    assert r.heartbeat(1, busy.model_copy(update={"busy_s": 13.0}), now=21.0) == []
    assert r.status(21.0).ranks[1].busy_at == "digits.py:33 in load"
    ended = r.heartbeat(1, Heartbeat(step=5), now=22.0)
    assert ended == [Notice("rank 1 responsive again (its event loop was busy for 13 s or more)")]
    assert r.state is JobState.RUNNING
    assert [t for _, t in r.events][-2:] == [started[0].text, ended[0].text]
