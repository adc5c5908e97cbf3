"""Running a worker's event loop: uvloop when installed, the stock loop otherwise (a
compute thread calls into it through ``collectives.threads.LoopBridge``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from shardwire.protocol import JobAborted, LeftJob
from shardwire.worker.runtime.launched import NotLaunched

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a fresh event loop.

    A process stopped because another rank failed exits with status 1 and one line
    naming that rank; the failed rank's own traceback is printed by that rank.
    """
    try:
        if use_uvloop:
            try:
                import uvloop
            except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
                pass
            else:
                return uvloop.run(main)
        return asyncio.run(main)
    except NotLaunched as exc:  # a script run by hand: the command, not a traceback
        print(f"shardwire: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except LeftJob as exc:  # a planned leave (SIGTERM under live recovery): no traceback
        print(f"shardwire: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except JobAborted as exc:
        print(f"shardwire: stopped: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C or SIGINT: the user knows why, no traceback
        print("shardwire: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
