"""A warm spare: a worker process a node agent starts ahead of any failure (live
recovery), with the interpreter up and shardwire, numpy and their dependencies already
imported, and the installed modules the rank's script imports (``launcher.preload``:
torch and ``shardwire.torch`` for a torch script), which becomes a failed rank's
replacement when the agent says so.

The agent writes one line of JSON to the spare's standard input: ``env`` (the rank's
whole environment, as a fresh process would get it) and ``argv`` (the script and its
arguments, or ``-m`` and a module and its arguments). The spare takes that environment,
closes its input (a rank's is empty) and runs the script as ``python -u SCRIPT`` or
``python -u -m MODULE`` would: as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as
they set them. If its input closes with no line, nobody needed it, and it exits 0.

    python -u -m shardwire.worker.launcher.spare [SCRIPT | -m MODULE]
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import shardwire.worker  # noqa: F401 - the imports a rank's start spends most of its time on
from shardwire.worker.launcher.preload import preload

ORDER_BYTES = 1 << 20  # the largest order line read (an environment and an argv)


def become(order: dict) -> None:
    """Take the rank's environment and arguments from ``order`` and run its script."""
    env, argv = order["env"], list(order["argv"])
    if not isinstance(env, dict) or not argv or not all(isinstance(a, str) for a in argv):
        raise SystemExit(f"shardwire spare: a malformed order: {order!r:.200}")
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    sys.stdin.close()
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - stdin for the process' life
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's path first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    preload(sys.argv[1:])  # the script the spare may become (or -m and its module)
    line = sys.stdin.readline(ORDER_BYTES)
    if not line.strip():
        return 0  # the agent closed our input: not needed
    become(json.loads(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
