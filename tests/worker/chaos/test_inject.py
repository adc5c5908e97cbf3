"""A chaos-run rank stopped by SIGTERM says so in the chaos log, then ends as it would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

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


def test_a_stopped_rank_notes_sigterm_and_still_dies_of_it(tmp_path) -> None:
    log = tmp_path / "chaos.jsonl"
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(log)], check=False, timeout=60)
    assert done.returncode == -signal.SIGTERM
    (entry,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert entry["event"] == "ended" and entry["outcome"] == "SIGTERM"
