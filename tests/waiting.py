"""Waiting in tests for something that happens by itself (a sweep, a forwarded beat):
polled, and bounded generously, since the bound is never the feature under test."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_POLL = 0.02


async def until(check: Callable[[], object], what: str = "", timeout: float = 20.0) -> None:
    """Return once ``check()`` is true; fail naming ``what`` after ``timeout`` seconds."""
    for _ in range(max(1, round(timeout / _POLL))):
        if check():
            return
        await asyncio.sleep(_POLL)
    raise AssertionError(f"not within {timeout:g} s: {what or 'the condition'}")
