"""Where a process's code is: trimmed Python stacks of a thread or of asyncio tasks, and
the innermost frame of the user's own code ("digits.py:33 in load").

Library frames (the standard library, installed packages, shardwire itself) are kept in
the stack text but skipped when naming the place, because "busy at ssl.py:1134" tells a
user less than the line of their script that called into it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterable
from types import FrameType

import shardwire.protocol

_FRAMES = 24  # innermost frames kept per stack
_TEXT = 8000  # characters of stack text kept in all (the message field holds 8192)
# the shardwire package, all of it (wherever it is installed or put on the path)
_OURS = {os.path.dirname(os.path.dirname(os.path.abspath(shardwire.protocol.__file__ or "")))}
_LIBRARY = tuple(
    {
        os.path.abspath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
    | _OURS
)


def is_user_file(filename: str) -> bool:
    """True for the user's own source files (not frozen, stdlib, site-packages, ours)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    return not any(path.startswith(root + os.sep) for root in _LIBRARY)


def _summary(frames: Iterable[FrameType]) -> traceback.StackSummary:
    return traceback.StackSummary.extract(((f, f.f_lineno) for f in frames), lookup_lines=True)


def _outermost_first(frame: FrameType | None) -> list[FrameType]:
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    return chain[::-1]


def place(stack: traceback.StackSummary) -> str:
    """The innermost user frame as ``file.py:LINE in func`` (else the innermost frame)."""
    mine = [f for f in stack if is_user_file(f.filename)] or list(stack)
    if not mine:
        return ""
    frame = mine[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def has_user_frame(stack: traceback.StackSummary) -> bool:
    return any(is_user_file(f.filename) for f in stack)


def thread_stack(thread_id: int) -> traceback.StackSummary:
    """The current stack of a thread of this process (empty if it has ended)."""
    frame = sys._current_frames().get(thread_id)
    return _summary(_outermost_first(frame)[-_FRAMES:])


def task_stack(task: asyncio.Task) -> traceback.StackSummary:
    """The await chain of a task, outermost first (``Task.get_stack`` shows only the
    outermost coroutine of a suspended task, so the chain is followed by hand)."""
    frames: list[FrameType] = []
    coro: object = task.get_coro()
    while coro is not None and len(frames) < 4 * _FRAMES:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return _summary(frames[-_FRAMES:])


def render(sections: list[tuple[str, traceback.StackSummary]]) -> str:
    """Stacks as text under a title each, clipped to the message field's size."""
    parts = [f"{title}:\n" + "".join(stack.format()) for title, stack in sections]
    text = "".join(parts)
    return text if len(text) <= _TEXT else "...\n" + text[-_TEXT:]


def busy_threads(*, skip: set[int]) -> list[tuple[str, traceback.StackSummary]]:
    """Stacks of other threads that are running the user's code (idle pools skipped)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    found = []
    for ident in sys._current_frames():
        if ident in skip:
            continue
        stack = thread_stack(ident)
        if has_user_frame(stack):
            found.append((f"thread {names.get(ident, ident)!s}", stack))
    return found
