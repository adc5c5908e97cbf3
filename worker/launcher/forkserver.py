"""A node's fork server: one process per node agent that imports shardwire, numpy and the
installed modules the rank's script imports (``launcher.preload``: torch and
``shardwire.torch`` for a torch script) once, and forks every rank process of the node
from there: at the start, on a relaunch, and a failed rank's replacement under live
recovery. A rank then starts in milliseconds instead of the second or more its imports
take (torch alone: about 1.8 s on a small machine), and a node's ranks import once
between them instead of once each.

Theory of operation. The agent starts it as

    python -u -m shardwire.worker.launcher.forkserver [SCRIPT | -m MODULE]

with one end of a ``SOCK_SEQPACKET`` socket pair as its standard input (the server moves
it off descriptor 0 and puts /dev/null there). Every message is one JSON object. Once
imported it says ``{"ready": THREADS}``, the Python threads it runs: the agent sends
orders only when that is 1 (else it closes its end), as a fork copies the calling thread
alone, and a lock another thread's Python code held would stay held in the child.
(Native threads that libraries start at import, OpenBLAS's or jemalloc's, are left:
those libraries make ready for a fork.) Then, for each order ``{"id": N, "env": {...},
"argv": [...]}``, which comes with two descriptors (the rank's stdout and stderr,
``SCM_RIGHTS``), it forks a child and answers ``{"started": N, "pid": PID}``; a
malformed order is answered ``{"refused": N, "why": "..."}``. The child leads a new
session (as a rank's process does), takes those descriptors as 1 and 2, draws a fresh
seed for numpy's global generator if the server imported it (Python's ``random``
reseeds itself at a fork) and
runs the script as ``python -u SCRIPT`` would (``become``). The server reaps its
children as SIGCHLD wakes it and reports each as ``{"exited": PID, "code": CODE}``, CODE
as asyncio gives a returncode (negative: the signal). When the agent closes its end the
server exits at once (``os._exit``: there is nothing to finish, and tearing down an
interpreter that imported torch takes 0.4 s), and the kernel ends it the moment its agent
ends; the ranks it forked end with it (each child's parent-death signal is tied to the
server from the fork on, ``runtime.parent``), so none goes on as a rank of a node that is
gone.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass

import shardwire.worker
from shardwire.protocol.exports import import_all
from shardwire.worker.launcher.preload import preload
from shardwire.worker.runtime.parent import end_with_parent

ORDER_BYTES = 1 << 20  # the largest order read (a rank's environment and argv)
REAP_EVERY = 5.0  # seconds between reaps when no SIGCHLD woke the server


@dataclass(frozen=True)
class Order:
    """What a freshly forked child runs: the agent's order and the rank's stdout and
    stderr descriptors that came with it."""

    order: dict
    fds: list[int]


def send(control: socket.socket, message: dict) -> None:
    control.send(json.dumps(message).encode())


def order_problem(order: object, fds: list[int]) -> str:
    """What is wrong with an order ("" if nothing is)."""
    if len(fds) != 2:
        return f"{len(fds)} descriptors came with it, not 2 (stdout, stderr)"
    if not isinstance(order, dict) or not isinstance(order.get("env"), dict):
        return "no environment"
    argv = order.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return "no argv"
    return ""


def take(control: socket.socket) -> bool | Order:
    """Read one order and fork its rank: True in the server, the order in the forked
    child, False once the agent closed its end."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(control, ORDER_BYTES, 2)
    except ConnectionError:
        return False
    if not data:
        for fd in fds:
            os.close(fd)
        return False
    try:
        order = json.loads(data)
    except ValueError:
        order = None
    problem = order_problem(order, fds)
    if problem:
        for fd in fds:
            os.close(fd)
        number = order.get("id") if isinstance(order, dict) else None
        send(control, {"refused": number, "why": problem})
        return True
    assert isinstance(order, dict)
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python 3.12 and later warn of any thread at a fork; the native ones libraries
        # start at import (OpenBLAS's, jemalloc's) are ready for a fork in their process
        warnings.simplefilter("ignore", DeprecationWarning)
        server = os.getpid()
        pid = os.fork()
    if pid == 0:
        # Tied to the server from its first instruction (a fork clears the parent-death
        # signal): the agent learns the pid before the child leads a session of its
        # own, and a server lost in between leaves no child its agent cannot kill.
        end_with_parent(server)
        return Order(order, fds)
    for fd in fds:
        os.close(fd)
    send(control, {"started": order.get("id"), "pid": pid})
    return True


def reap(control: socket.socket) -> None:
    """Report every child that ended since the last reap."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(control, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def drain(fd: int) -> None:
    """Empty the non-blocking pipe ``fd`` (the signal numbers SIGCHLD wrote to it)."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass


def serve(control: socket.socket) -> Order | None:
    """Fork ranks on the agent's orders until it closes its end (None). A forked child
    returns with its order, this function's signal handling undone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
    signal.set_wakeup_fd(wake_w)
    try:
        while True:  # ends when the agent closes its end (or is gone)
            readable, _, _ = select.select([control.fileno(), wake_r], [], [], REAP_EVERY)
            if wake_r in readable:
                drain(wake_r)
            reap(control)
            if control.fileno() in readable:
                taken = take(control)
                if taken is False:
                    return None
                if isinstance(taken, Order):
                    return taken  # in the forked child
    except BrokenPipeError:
        return None  # the agent is gone
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)


def become(order: dict, fds: list[int]) -> None:
    """In the forked child: take the rank's descriptors and environment, then run its
    script as ``python -u SCRIPT ARGS`` (or ``python -u -m MODULE ARGS``) would, as
    ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as it sets them."""
    os.setsid()
    out, err = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # imported ahead: the server's seed is every child's
        numpy_random.seed()
    argv = list(order["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's path first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    # The kernel ends the server the moment its agent ends (SIGKILL, its machine going),
    # and with it the ranks it forked (their parent-death signal is the server's, from
    # the fork on): none of them goes on as a rank of a node that is gone.
    end_with_parent(os.getppid())
    control = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    import_all(shardwire.worker)  # the imports a rank's start spends most of its time on
    preload(sys.argv[1:])  # the script the ranks run (or -m and its module)
    threads = threading.active_count()
    try:
        send(control, {"ready": threads})
        child = serve(control)  # until the agent closes its end (at once if it refuses)
    except BrokenPipeError:
        child = None  # the agent is gone
    if child is None:  # nothing to finish: no interpreter teardown (torch's takes 0.4 s)
        os._exit(0)
    control.close()
    become(child.order, child.fds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
