"""Running a worker's event loop: uvloop when installed, the stock loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a fresh event loop."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency, but optional in spirit
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)
