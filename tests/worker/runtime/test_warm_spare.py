"""A node agent's warm spare (live recovery): a dead rank's replacement is the spare,
already running with shardwire imported, which takes the rank's environment and
arguments and runs the script as a fresh process would; without it the process is
started then; no spare outlives its supervisor."""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
from pathlib import Path

import pytest

from shardwire.worker.launcher.supervisor import Launch, Supervisor

pytestmark = pytest.mark.e2e

SCRIPT = """
import os, sys
warm = "shardwire.worker" in sys.modules  # imported before the script ran
ahead = "xml.dom.minidom" in sys.modules  # the script's own import, made by the spare
import xml.dom.minidom
rank, marks = os.environ["RANK"], sys.argv[1]
first = not os.path.exists(os.path.join(marks, rank))
open(os.path.join(marks, rank), "w").close()
if rank == "1" and first:
    import time
    time.sleep(3.0)  # the spare is started 2 s after the ranks
    sys.exit(3)
if rank == "0":
    import time
    time.sleep(4.0)
print(f"rank {rank} warm={warm} ahead={ahead} args={sys.argv[1:]} "
      f"gen={os.environ['SHARDWIRE_GENERATION']} "
      f"path0={sys.path[0]} stdin={sys.stdin.read()!r} main={__name__}", flush=True)
"""


def _spares() -> list[int]:
    """This process's child processes running a spare."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid():
                continue
            if b"shardwire.worker.launcher.spare" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spare", [True, False])
async def test_a_dead_rank_s_replacement_is_the_warm_spare(tmp_path, spare: bool) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "marks").mkdir()
    argv = [sys.executable, "-u", str(script), str(tmp_path / "marks"), "--flag", "x y"]
    launch = Launch(
        argv,
        {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        "node-a",
        0,
        2,
        2,
        respawns=1,
        spare=spare,
    )
    out, err = io.StringIO(), io.StringIO()
    supervisor = Supervisor(launch, out=out, err=err)
    code = await asyncio.wait_for(supervisor.run(), 90)
    assert code == 0, err.getvalue()
    lines = dict(re.findall(r"^\[rank(\d)\]: (rank .*)$", out.getvalue(), re.M))
    replaced = lines["1"]
    assert f"warm={spare}" in replaced  # the spare had imported shardwire before the script
    assert f"ahead={spare}" in replaced  # and what the script imports
    assert f"args=['{tmp_path / 'marks'}', '--flag', 'x y']" in replaced
    assert "gen=0" in replaced and f"path0={tmp_path}" in replaced
    assert "stdin=''" in replaced and "main=__main__" in replaced
    assert "warm=False" in lines["0"] and "ahead=False" in lines["0"]
    said = "started anew from the warm spare" if spare else "started anew (pid"
    assert said in err.getvalue() and err.getvalue().count("started anew") == 1
    assert supervisor.spare.proc is None and _spares() == []  # none left behind


OVER = """
import os, sys, time
rank, marks = os.environ["RANK"], sys.argv[1]
first = not os.path.exists(os.path.join(marks, rank))
open(os.path.join(marks, rank), "w").close()
if rank == "1" and first:
    sys.exit(3)
time.sleep(1.0 if rank == "0" else 60.0)  # the replacement would wait for a gone coordinator
sys.exit(1)  # rank 0: "the job is over"
"""


@pytest.mark.timeout(120)
async def test_a_replacement_started_as_the_job_ends_is_stopped_with_it(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(OVER)
    (tmp_path / "marks").mkdir()
    argv = [sys.executable, "-u", str(script), str(tmp_path / "marks")]
    launch = Launch(
        argv,
        {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        "node-a",
        0,
        2,
        2,
        respawns=1,
        term_timeout=5.0,
    )
    err = io.StringIO()
    supervisor = Supervisor(launch, out=io.StringIO(), err=err)
    spawn, started = supervisor._spawn, []

    async def spawn_as_the_job_ends(local: int, env: dict[str, str]):
        if len(started) == 2:  # rank 1's replacement: the coordinator ends the job meanwhile
            supervisor.note_abort(1, "no restart is left", "")
        child = await spawn(local, env)
        started.append(child.proc)
        return child

    supervisor._spawn = spawn_as_the_job_ends  # type: ignore[method-assign]
    code = await asyncio.wait_for(supervisor.run(), 30)  # not the replacement's 60 s
    assert code != 0 and len(started) == 3
    assert started[2].returncode == -9  # the replacement was killed, not left waiting
    assert "started anew" not in err.getvalue()
    assert supervisor.root_cause is not None and supervisor.root_cause.rank == 1
