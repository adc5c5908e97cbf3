"""Matching of incoming data frames with posted receives.

Theory of operation
-------------------
Messages are matched by (source rank, tag), first in first out for equal keys. When a
frame header arrives, :meth:`Mailbox.destination` picks where its payload goes: straight
into the ``out`` array of a receive that is already posted (zero copy), or into a fresh
array that is held until the receive comes (an *early arrival*, bounded by
``max_early_bytes``: past the bound the transport stops reading from the wire until a
receive drains the backlog). A frame that does not match the posted receive (op, dtype
or shape) fails that receive with :class:`MessageMismatch` and its payload is drained
into scratch space, so the stream stays in sync.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardwire.protocol import MessageMismatch, Tag, TensorMeta, check_dtype

Key = tuple[int, Tag]


@dataclass(slots=True)
class _Posted:
    op: str
    out: np.ndarray | None
    future: asyncio.Future[np.ndarray]
    filling: bool = False


@dataclass(slots=True)
class _Inbound:
    """A frame whose payload is arriving (or has arrived) into ``array``."""

    meta: TensorMeta
    array: np.ndarray
    posted: _Posted | None
    error: MessageMismatch | None = None


def byte_view(array: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _describe(meta: TensorMeta) -> str:
    return f"{meta.op} #{meta.tag.seq} ({meta.dtype}{list(meta.shape)})"


def check_match(meta: TensorMeta, op: str, out: np.ndarray | None, rank: int) -> None:
    """Raise :class:`MessageMismatch` if a frame does not fit the posted receive."""
    problem = ""
    if meta.op != op:
        problem = f"expected {op} #{meta.tag.seq}, got {_describe(meta)}"
    elif out is not None and (check_dtype(out.dtype) != meta.dtype or out.shape != meta.shape):
        problem = (
            f"expected {out.dtype}{list(out.shape)} for {op} #{meta.tag.seq}, "
            f"got {meta.dtype}{list(meta.shape)}"
        )
    if problem:
        raise MessageMismatch(f"rank {rank} from rank {meta.src}: {problem}")


class Mailbox:
    """Posted receives and early arrivals for one rank."""

    def __init__(self, rank: int, *, max_early_bytes: int, on_drain: Callable[[], None]):
        self.rank = rank
        self.max_early_bytes = max_early_bytes
        self.early_bytes = 0
        self._on_drain = on_drain
        self._posted: dict[Key, deque[_Posted]] = {}
        self._early: dict[Key, deque[tuple[TensorMeta, np.ndarray]]] = {}

    @property
    def over_budget(self) -> bool:
        return self.early_bytes > self.max_early_bytes

    def post(self, src: int, tag: Tag, op: str, out: np.ndarray | None) -> asyncio.Future:
        """Register a receive; completes at once if the message is already here."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        posted = _Posted(op, out, future)
        key = (src, tag)
        early = self._early.get(key)
        if early:
            meta, array = early.popleft()
            if not early:
                del self._early[key]
            self._release(array.nbytes)
            self._complete(posted, meta, array)
        else:
            self._posted.setdefault(key, deque()).append(posted)
        return future

    def _complete(self, posted: _Posted, meta: TensorMeta, array: np.ndarray) -> None:
        """Hand a held message to a receive (one copy when it has an ``out`` array)."""
        try:
            check_match(meta, posted.op, posted.out, self.rank)
        except MessageMismatch as exc:
            posted.future.set_exception(exc)
            return
        if posted.out is not None:
            np.copyto(posted.out, array)
            array = posted.out
        posted.future.set_result(array)

    def has_posted(self, meta: TensorMeta) -> bool:
        """True if a receive is waiting for this message."""
        return any(not p.future.done() for p in self._posted.get((meta.src, meta.tag), ()))

    def withdraw(self, src: int, tag: Tag, future: asyncio.Future) -> None:
        """Forget a receive whose waiter gave up (cancelled or timed out)."""
        queue = self._posted.get((src, tag))
        if not queue:
            return
        for posted in list(queue):
            if posted.future is future and not posted.filling:
                queue.remove(posted)
        if not queue:
            self._posted.pop((src, tag), None)

    def begin(self, meta: TensorMeta) -> _Inbound:
        """A frame header arrived: decide where its payload goes."""
        posted = self._take_posted((meta.src, meta.tag))
        if posted is None:
            self.early_bytes += meta.nbytes
            return _Inbound(meta, np.empty(meta.shape, meta.dtype), None)
        try:
            check_match(meta, posted.op, posted.out, self.rank)
        except MessageMismatch as exc:
            return _Inbound(meta, np.empty(meta.shape, meta.dtype), posted, exc)
        posted.filling = True
        target = posted.out if posted.out is not None else np.empty(meta.shape, meta.dtype)
        return _Inbound(meta, target, posted)

    def finish(self, inbound: _Inbound) -> None:
        """The payload of ``inbound`` is complete."""
        posted = inbound.posted
        if posted is None:
            # The receive may have been posted while this payload was still arriving.
            key = (inbound.meta.src, inbound.meta.tag)
            late = self._take_posted(key)
            if late is None:
                self._early.setdefault(key, deque()).append((inbound.meta, inbound.array))
            else:
                self._release(inbound.array.nbytes)
                self._complete(late, inbound.meta, inbound.array)
            return
        if posted.future.done():
            return
        if inbound.error is not None:
            posted.future.set_exception(inbound.error)
        else:
            posted.future.set_result(inbound.array)

    def _take_posted(self, key: Key) -> _Posted | None:
        queue = self._posted.get(key)
        posted = None
        while queue and posted is None:
            candidate = queue.popleft()
            if not candidate.future.done():
                posted = candidate
        if queue is not None and not queue:
            del self._posted[key]
        return posted

    def deliver(self, meta: TensorMeta, array: np.ndarray) -> None:
        """Hand over a complete in-memory message (copies it once)."""
        inbound = self.begin(meta)
        np.copyto(inbound.array, array, casting="no")
        self.finish(inbound)

    def fail(self, exc: BaseException, *, src: int | None = None) -> None:
        """Fail pending receives (all, or only those from ``src``)."""
        for key in list(self._posted):
            if src is not None and key[0] != src:
                continue
            for posted in self._posted.pop(key):
                if not posted.future.done():
                    posted.future.set_exception(exc)

    def pending_sources(self) -> list[int]:
        return sorted({src for (src, _tag), q in self._posted.items() if q})

    def _release(self, nbytes: int) -> None:
        was_over = self.over_budget
        self.early_bytes -= nbytes
        if was_over and not self.over_budget:
            self._on_drain()
