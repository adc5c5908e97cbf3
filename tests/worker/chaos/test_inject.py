"""A chaos-run rank stopped by SIGTERM says so in the chaos log, then ends as it would;
a fault at a collective fires as that call is placed, through the group's call watch."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from shardwire.worker.chaos.faultlog import read_log
from shardwire.worker.chaos.inject import InjectedFault, Injector
from shardwire.worker.chaos.plan import load
from shardwire.worker.collectives.process import ProcessGroup, StepState
from tests.worker.transport.fabric import memory_world

PROGRAM = """
import json, os, signal, sys, time
from shardwire.worker.chaos.inject import _note_termination

class Log:
    def note(self, entry):
        with open(sys.argv[1], "a") as out:
            out.write(json.dumps({"rank": 1, "t": time.time(), **entry}) + "\\n")

_note_termination(Log())
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
sys.exit(3)  # never: SIGTERM ends the process as without the note
"""


@pytest.mark.e2e
def test_a_stopped_rank_notes_sigterm_and_still_dies_of_it(tmp_path) -> None:
    log = tmp_path / "chaos.jsonl"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(log)], check=False, timeout=60)
    assert done.returncode == -signal.SIGTERM
    (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["event"] == "ended" and entry["outcome"] == "SIGTERM"


async def test_a_watched_group_tells_each_call_and_a_raise_at_a_collective_fails_that_call(
    tmp_path,
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[[faults]]\nkind = 'raise'\nrank = 0\ncollective = 3\n")
    log = tmp_path / "chaos.jsonl"
    async with memory_world(2, timeout=10.0) as transports:
        groups = [
            ProcessGroup(t, local_rank=r, local_world_size=2, node_rank=0, generation=1)
            for r, t in enumerate(transports)
        ]
        seen: list[tuple[int, str]] = []
        groups[1].watch_calls(lambda seq, op: seen.append((seq, op)))
        assert "_start" not in vars(groups[0])  # an unwatched group's calls go as ever
        injector = Injector(load(plan), groups[0], log)
        x = np.ones(8)
        for _ in range(2):
            await asyncio.gather(*(g.all_reduce(x) for g in groups))
        with pytest.raises(InjectedFault):
            await groups[0].barrier()  # seq 3 on rank 0: the call fails, the rank with it
        with pytest.raises(InjectedFault):
            await groups[0].all_reduce(x)
        injector.ended(None)
        assert seen == [(1, "all_reduce"), (2, "all_reduce")]
    (hit,) = [e for e in read_log(log) if e["event"] == "injected"]
    assert (hit["collective"], hit["op"], hit["rank"]) == (3, "barrier", 0)


@pytest.mark.parametrize(("every", "noted"), [(1, [1, 2, 3, 4]), (2, [2, 4]), (0, [])])
async def test_state_is_noted_every_check_every_steps_with_its_fingerprints(
    tmp_path, every: int, noted: list[int]
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f"check_every = {every}\n[[faults]]\nkind = 'kill'\nrank = 1\nstep = 99\n")
    log = tmp_path / "chaos.jsonl"
    weights = np.arange(4.0)
    async with memory_world(2) as transports:
        group = ProcessGroup(
            transports[0], local_rank=0, local_world_size=2, node_rank=0, generation=1
        )
        injector = Injector(load(plan), group, log)
        for step in range(1, 5):
            read = np.array([step, step + 1])
            group.step_finished(step, StepState(read, lambda: ("whole", [weights]), 0.5))
            group.step_finished(step)  # report_progress's call: nothing more is noted
        injector.ended(None)
    states = [e for e in read_log(log) if e["event"] == "state"]
    assert [e["step"] for e in states] == noted
    if states:
        first, second = states[0], states[-1]
        assert first["key"] == "whole" and first["digest"] == second["digest"]  # same bytes
        assert first["read"] != second["read"] and first["loss"] == 0.5
        assert len(first["digest"]) == 16 and first["generation"] == 1
