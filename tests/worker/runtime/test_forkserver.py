"""A node's fork server: every rank process of the node, a dead rank's replacement
too, is forked from one process that imported shardwire and the script's installed
imports ahead, and runs the script as ``python -u SCRIPT`` would (its arguments,
environment, ``sys.path[0]``, an empty stdin, a session of its own, a numpy seed of its
own); without a server that serves, the supervisor starts each process itself; a
server's loss ends the ranks it forked, said; no server outlives its agent."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardwire.worker.launcher.exits import process_state
from shardwire.worker.launcher.forking import ForkServer, server_command
from shardwire.worker.launcher.supervisor import Launch, Supervisor, thread_defaults

# a node agent runs on the stock asyncio loop (the launcher does not use uvloop)
pytestmark = [pytest.mark.e2e, pytest.mark.one_loop]

SCRIPT = """
import os, sys
warm = "shardwire.worker" in sys.modules  # imported before the script ran
ahead = "xml.dom.minidom" in sys.modules  # the script's own import, made by the server
import xml.dom.minidom
import numpy.random  # imported ahead too, with the global generator's seed
import numpy as np
rank, marks = os.environ["RANK"], sys.argv[1]
first = not os.path.exists(os.path.join(marks, rank))
open(os.path.join(marks, rank), "w").close()
if rank == "1" and first:
    sys.exit(3)
if rank == "0":
    import time
    time.sleep(1.0)
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
print(f"rank {rank} warm={warm} ahead={ahead} args={sys.argv[1:]} "
      f"gen={os.environ['SHARDWIRE_GENERATION']} path0={sys.path[0]} "
      f"stdin={sys.stdin.read()!r} main={__name__} session={os.getsid(0) == os.getpid()} "
      f"server={b'shardwire.worker.launcher.forkserver' in parent} "
      f"seed={np.random.randint(1 << 62)}", flush=True)
"""


def _ended_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` is gone (or a zombie nobody reaped yet) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while process_state(pid) not in ("", "Z", "X"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _server(argv: list[str], env: dict[str, str], err: io.StringIO) -> ForkServer:
    forks = ForkServer(server_command(argv), {**thread_defaults(env), **env}, err=err)
    forks.start()
    return forks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "started"])
async def test_every_rank_and_a_replacement_is_forked_and_runs_as_a_fresh_process(
    tmp_path, forked: bool
) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    (tmp_path / "marks").mkdir()
    argv = [sys.executable, "-u", str(script), str(tmp_path / "marks"), "--flag", "x y"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    launch = Launch(argv, env, "node-a", 0, 2, 2, respawns=1)
    out, err = io.StringIO(), io.StringIO()
    forks = _server(argv, env, err) if forked else None
    supervisor = Supervisor(launch, forks=forks, out=out, err=err)
    try:
        code = await asyncio.wait_for(supervisor.run(), 90)
    finally:
        if forks is not None:
            await forks.aclose()
    assert code == 0, err.getvalue()
    lines = dict(re.findall(r"^\[rank(\d)\]: (rank .*)$", out.getvalue(), re.M))
    for rank in "01":
        said = lines[rank]
        assert f"warm={forked}" in said and f"ahead={forked}" in said  # imported ahead
        assert f"server={forked}" in said, said  # the server is the parent
        assert f"args=['{tmp_path / 'marks'}', '--flag', 'x y']" in said
        assert f"path0={tmp_path}" in said and "main=__main__" in said
        assert "stdin=''" in said and "session=True" in said
    assert "gen=0" in lines["1"]  # the replacement joins whichever generation forms
    seeds = {re.search(r"seed=(\d+)", lines[r]).group(1) for r in "01"}  # type: ignore[union-attr]
    assert len(seeds) == 2  # each rank draws numpy's global seed anew
    said = "started anew, forked (pid" if forked else "started anew (pid"
    assert said in err.getvalue() and err.getvalue().count("started anew") == 1
    if forks is not None:
        assert forks.proc is not None and forks.proc.returncode is not None  # not left behind


THREADED = """
import threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
"""


@pytest.mark.timeout(120)
async def test_a_server_running_a_python_thread_forks_nothing_and_ranks_start_on_their_own(
    tmp_path,
) -> None:
    """An installed module the script imports starts a thread at import: a fork would
    copy one thread and whatever locks the other's Python code held."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "threaded_at_import.py").write_text(THREADED)
    (tmp_path / "job").mkdir()  # not beside the module: that one is "installed"
    script = tmp_path / "job" / "job.py"
    script.write_text("import threaded_at_import\n" + SCRIPT)
    (tmp_path / "marks").mkdir()
    argv = [sys.executable, "-u", str(script), str(tmp_path / "marks")]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path / "site")}
    out, err = io.StringIO(), io.StringIO()
    forks = _server(argv, env, err)
    launch = Launch(argv, env, "node-a", 0, 2, 2, respawns=1)
    supervisor = Supervisor(launch, forks=forks, out=out, err=err)
    try:
        assert await asyncio.wait_for(supervisor.run(), 90) == 0, err.getvalue()
    finally:
        await forks.aclose()
    assert "runs 2 Python threads after its imports" in err.getvalue()
    assert "server=False" in out.getvalue() and "server=True" not in out.getvalue()


@pytest.mark.timeout(120)
async def test_a_lost_server_s_ranks_are_killed_and_said_to_be(tmp_path) -> None:
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(60)\n")
    argv = [sys.executable, "-u", str(script)]
    err = io.StringIO()
    forks = _server(argv, dict(os.environ), err)
    try:
        proc = await forks.fork(dict(os.environ), argv[2:])
        assert proc is not None and forks.proc is not None
        os.kill(forks.proc.pid, signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), 30) == -signal.SIGKILL
        assert "ended: the 1 rank process(es) it forked are killed" in err.getvalue()
        assert await asyncio.to_thread(_ended_within, proc.pid, 30.0)
        assert await forks.fork(dict(os.environ), argv[2:]) is None  # the caller starts it
    finally:
        await forks.aclose()


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


AGENT = """
import asyncio, io, os, sys
from shardwire.worker.launcher.forking import ForkServer, server_command

async def main():
    argv = [sys.executable, "-u", sys.argv[1]]
    forks = ForkServer(server_command(argv), dict(os.environ), err=io.StringIO())
    forks.start()
    rank = await forks.fork(dict(os.environ), argv[2:])
    print(forks.proc.pid, rank.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""
SLOW_EXIT = "import atexit, time\natexit.register(time.sleep, 60)\n"


@pytest.mark.timeout(120)
async def test_a_killed_agent_s_server_and_its_ranks_end_at_once(tmp_path) -> None:
    """The agent SIGKILLed (its node lost): its fork server ends with it, however long
    the server's own exit would take (an import of the script's registered a 60 s exit
    handler in the server: it does not run). The ranks it forked that joined the job end
    with the server (``runtime.parent``); this one never joins, and is ended here."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "slowexit.py").write_text(SLOW_EXIT)
    (tmp_path / "job").mkdir()
    script = tmp_path / "job" / "wait.py"
    script.write_text("import slowexit, time\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", AGENT, str(script), env=env, stdout=asyncio.subprocess.PIPE
    )
    rank = 0
    try:
        assert agent.stdout is not None
        line = await asyncio.wait_for(agent.stdout.readline(), 60)
        server, rank = map(int, line.split())
        agent.kill()
        await asyncio.wait_for(agent.wait(), 30)
        # the kernel ends them with their parent: seconds at most, even on a busy machine,
        # where the server's exit handler would hold it for 60
        assert await asyncio.to_thread(_ended_within, server, 20.0)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        if rank:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGKILL)


# A server that forks one child on the order it reads, then is gone at once; its child
# stays where a child stands before it leads a session of its own (and runs nothing).
FORK_AND_GO = """
import os, socket, sys, time
from shardwire.worker.launcher.forkserver import take
if take(socket.socket(fileno=int(sys.argv[1]))) is True:
    os._exit(0)
time.sleep(60)
"""


def test_a_child_whose_server_is_gone_before_it_leads_a_session_ends_too(tmp_path) -> None:
    agent, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        order = {"id": 1, "env": {}, "argv": ["-c", "pass"]}
        socket.send_fds(agent, [json.dumps(order).encode()], [out, out])
        server = subprocess.Popen(
            [sys.executable, "-c", FORK_AND_GO, str(server_end.fileno())],
            pass_fds=(server_end.fileno(),),
        )
        assert server.wait(timeout=60) == 0
        agent.settimeout(60)
        started = json.loads(agent.recv(4096))
        # nothing killed it: the kernel did, as its server ended (not 60 s from now)
        assert _ended_within(started["pid"], 30.0), process_state(started["pid"])
    finally:
        os.close(out)
        agent.close()
        server_end.close()
