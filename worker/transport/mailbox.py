"""Matching of incoming data frames with posted receives.

Theory of operation
-------------------
Messages are matched by (source rank, tag), first in first out for equal keys; a
receive from any source (``post_any``) takes the first message of its tag that no
receive naming its source waits for. When a frame header arrives, :meth:`Mailbox.begin`
picks where its payload goes: straight into the ``out`` array of a receive that is
already posted (zero copy), or into a fresh array held until the receive comes (an
*early arrival*, bounded by ``max_early_bytes``: past the bound the transport stops
reading from the wire until a receive drains the backlog).

Every frame carries an op *signature* (for collectives: name, dtype, size, reduction),
and all frames of one call share (group, seq). The mailbox remembers the signature of the
calls it has receives posted for and of the early frames it holds, so ranks that made
different calls are caught on the first frame, whichever step of an algorithm it
belongs to. A mismatch fails the receives of that call with :class:`MessageMismatch`;
the payload is drained into scratch space, so the stream stays in sync.

A *poison* frame (op ``__poison__``) carries another rank's error for a whole group: it
fails every pending receive of the group and every later one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shardwire.protocol import MessageMismatch, Tag, TensorMeta, check_dtype
from shardwire.protocol.codec import unpack_object
from shardwire.protocol.errors import ProtocolError, relayed_error
from shardwire.protocol.messages import Poison, decode_message
from shardwire.worker.transport.base import Fold

Key = tuple[int, Tag]
Call = tuple[int, int]  # (group, seq)
POISON_OP = "__poison__"


@dataclass(slots=True)
class Posted:
    """A receive waiting in the mailbox; its future completes with the message."""

    op: str
    out: np.ndarray | None
    future: asyncio.Future
    filling: bool = False
    fold: Fold | None = None
    wild: bool = False  # from any source: completes with (source rank, array)
    began: float = 0.0  # when its payload began to arrive (0: it was here first)

    def resolve(self, meta: TensorMeta, array: np.ndarray) -> None:
        self.future.set_result((meta.src, array) if self.wild else array)


@dataclass(slots=True)
class Inbound:
    """A frame whose payload is arriving (or has arrived) into ``array``."""

    meta: TensorMeta
    array: np.ndarray
    posted: Posted | None
    error: MessageMismatch | None = None
    drop: bool = False  # a mismatched frame nobody will receive
    folded: bool = False  # its pieces went to the receive's fold as they arrived

    @property
    def foldable(self) -> bool:
        """Whether pieces may go straight to the receive's fold (no copy into ``array``)."""
        p = self.posted
        return p is not None and p.fold is not None and self.error is None and not self.drop


def byte_view(array: np.ndarray) -> memoryview:
    """A flat, writable-if-possible byte view of a C-contiguous array (no copy)."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    """Fail a receive unless it already ended. Its waiter may be gone (a collective stops
    at its first error), so the exception counts as retrieved, never logged."""
    if not future.done():
        future.set_exception(exc)
        future.exception()


def _scratch(meta: TensorMeta) -> np.ndarray:
    return np.empty(meta.shape, meta.dtype)


def _mismatch(rank: int, src: int, seq: int, ours: str, theirs: str) -> MessageMismatch:
    return MessageMismatch(
        f"call #{seq}: rank {rank} called {ours}, but rank {src} called {theirs}"
    )


def check_match(meta: TensorMeta, op: str, out: np.ndarray | None, rank: int) -> None:
    """Raise :class:`MessageMismatch` if a frame does not fit the posted receive."""
    if meta.op != op:
        raise _mismatch(rank, meta.src, meta.tag.seq, op, meta.op)
    if out is not None and (check_dtype(out.dtype) != meta.dtype or out.shape != meta.shape):
        raise MessageMismatch(
            f"rank {rank} from rank {meta.src}: expected {out.dtype}{list(out.shape)} for "
            f"{op} #{meta.tag.seq}, got {meta.dtype}{list(meta.shape)}"
        )


class Mailbox:
    """Posted receives and early arrivals for one rank."""

    def __init__(
        self,
        rank: int,
        *,
        max_early_bytes: int,
        on_drain: Callable[[], None],
        on_notice: Callable[[Poison], None] = lambda _notice: None,
    ):
        self.rank = rank
        self.max_early_bytes = max_early_bytes
        self.early_bytes = 0
        self._on_drain = on_drain
        self._on_notice = on_notice  # a poison notice arrived (after failing the group)
        self._posted: dict[Key, deque[Posted]] = {}
        self._wild: dict[Tag, deque[Posted]] = {}  # receives from any source
        self._early: dict[Key, deque[tuple[TensorMeta, np.ndarray]]] = {}
        self._calls: dict[Call, list] = {}  # our posted calls: [op, receives listed]
        self._early_calls: dict[Call, list] = {}  # held frames: [src, op, count]
        self._group_errors: dict[int, BaseException] = {}

    @property
    def over_budget(self) -> bool:
        return self.early_bytes > self.max_early_bytes

    # ---- receives ----------------------------------------------------------------------

    def post(
        self, src: int, tag: Tag, op: str, out: np.ndarray | None, fold: Fold | None = None
    ) -> Posted:
        """Register a receive; its future completes at once if the message is already
        here. With ``fold``, the message is folded (see :data:`Fold`) before it completes."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        posted = Posted(op, out, future, fold=fold)
        group_error = self._group_errors.get(tag.group)
        if group_error is not None:
            _fail(future, group_error)
            return posted
        call = (tag.group, tag.seq)
        held = self._early_calls.get(call)
        if held is not None and held[1] != op:
            _fail(future, _mismatch(self.rank, held[0], tag.seq, op, held[1]))
            return posted
        key = (src, tag)
        if self._early.get(key):
            self._serve_early(key, posted)
        else:
            self._posted.setdefault(key, deque()).append(posted)
            entry = self._calls.setdefault(call, [op, 0])
            entry[0] = op
            entry[1] += 1
        return posted

    def post_any(self, tag: Tag, op: str, out: np.ndarray | None) -> asyncio.Future:
        """Register a receive of ``tag`` from any source; its future completes with
        (source rank, array). A message already here is taken at once."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        group_error = self._group_errors.get(tag.group)
        if group_error is not None:
            _fail(future, group_error)
            return future
        posted = Posted(op, out, future, wild=True)
        key = next((k for k in self._early if k[1] == tag), None)  # held: bounded bytes
        if key is not None:
            self._serve_early(key, posted)
        else:
            self._wild.setdefault(tag, deque()).append(posted)
        return future

    def withdraw_any(self, tag: Tag, future: asyncio.Future) -> None:
        """Forget a receive from any source whose waiter gave up."""
        queue = self._wild.get(tag)
        if queue:
            for posted in [p for p in queue if p.future is future and not p.filling]:
                queue.remove(posted)
        if not queue:
            self._wild.pop(tag, None)

    def _serve_early(self, key: Key, posted: Posted) -> None:
        """Complete ``posted`` with the oldest message held under ``key``."""
        early = self._early[key]
        meta, array = early.popleft()
        if not early:
            del self._early[key]
        self._release(meta, array.nbytes)
        self._complete(posted, meta, array)

    def _unlisted(self, tag: Tag) -> None:
        """A posted receive of ``tag``'s call left the posted queues."""
        call = (tag.group, tag.seq)
        entry = self._calls.get(call)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._calls[call]

    def _complete(self, posted: Posted, meta: TensorMeta, array: np.ndarray) -> None:
        """Hand a held message to a receive (one copy when it has an ``out`` array)."""
        try:
            check_match(meta, posted.op, posted.out, self.rank)
        except MessageMismatch as exc:
            _fail(posted.future, exc)
            return
        if posted.out is not None:
            np.copyto(posted.out, array)
            array = posted.out
        if posted.fold is not None:
            posted.fold(array.reshape(-1), 0)
        posted.resolve(meta, array)

    def has_posted(self, meta: TensorMeta) -> bool:
        """True if a receive is waiting for this message."""
        return any(not p.future.done() for p in self._posted.get((meta.src, meta.tag), ())) or any(
            not p.future.done() for p in self._wild.get(meta.tag, ())
        )

    def withdraw(self, src: int, tag: Tag, future: asyncio.Future) -> None:
        """Forget a receive whose waiter gave up (cancelled or timed out)."""
        queue = self._posted.get((src, tag))
        if not queue:
            return
        for posted in list(queue):
            if posted.future is future and not posted.filling:
                queue.remove(posted)
                self._unlisted(tag)
        if not queue:
            self._posted.pop((src, tag), None)

    # ---- arrivals ----------------------------------------------------------------------

    def begin(self, meta: TensorMeta) -> Inbound:
        """A frame header arrived: decide where its payload goes."""
        if meta.op == POISON_OP:
            return Inbound(meta, _scratch(meta), None, drop=True)
        call = (meta.tag.group, meta.tag.seq)
        ours = self._calls.get(call)
        if ours is not None and ours[0] != meta.op:
            self._fail_call(call, _mismatch(self.rank, meta.src, meta.tag.seq, ours[0], meta.op))
            return Inbound(meta, _scratch(meta), None, drop=True)
        posted = self._take_posted((meta.src, meta.tag)) or self._take_wild(meta.tag)
        if posted is None:
            self._hold(meta)
            return Inbound(meta, _scratch(meta), None)
        try:
            check_match(meta, posted.op, posted.out, self.rank)
        except MessageMismatch as exc:
            return Inbound(meta, _scratch(meta), posted, exc)
        posted.filling = True
        posted.began = time.monotonic()
        target = posted.out if posted.out is not None else _scratch(meta)
        return Inbound(meta, target, posted)

    def finish(self, inbound: Inbound) -> None:
        """The payload of ``inbound`` is complete."""
        meta = inbound.meta
        if meta.op == POISON_OP:
            notice = decode_message(unpack_object(inbound.array.tobytes()))
            if not isinstance(notice, Poison) or notice.group != meta.tag.group:
                raise ProtocolError(f"rank {meta.src} sent a malformed poison notice")
            error = relayed_error(notice.error, notice.message, notice.origin)
            self.poison_group(notice.group, error)
            self._on_notice(notice)
            return
        if inbound.drop:
            return
        posted = inbound.posted
        if posted is None:
            # The receive may have been posted while this payload was still arriving.
            key = (meta.src, meta.tag)
            late = self._take_posted(key) or self._take_wild(meta.tag)
            if late is None:
                self._early.setdefault(key, deque()).append((meta, inbound.array))
            else:
                self._release(meta, inbound.array.nbytes)
                self._complete(late, meta, inbound.array)
            return
        if posted.future.done():
            return
        if inbound.error is not None:
            _fail(posted.future, inbound.error)
            return
        if posted.fold is not None and not inbound.folded:
            posted.fold(inbound.array.reshape(-1), 0)
        posted.resolve(meta, inbound.array)

    def abandon(self, inbound: Inbound, exc: BaseException) -> None:
        """The payload of ``inbound`` will never complete (its connection is gone or it
        arrived corrupted): fail its receive, if one was posted, with ``exc``."""
        if inbound.posted is not None:
            _fail(inbound.posted.future, exc)
        elif inbound.meta.op != POISON_OP and not inbound.drop:
            self._release(inbound.meta, inbound.array.nbytes)  # held as an early arrival

    def reject(self, inbound: Inbound, exc: BaseException) -> None:
        """The payload of ``inbound`` arrived corrupted: fail its receive and every
        pending and later receive of its group with ``exc``."""
        self.abandon(inbound, exc)
        self.poison_group(inbound.meta.tag.group, exc)

    def deliver(self, meta: TensorMeta, array: np.ndarray) -> None:
        """Hand over a complete in-memory message (copies it once)."""
        inbound = self.begin(meta)
        np.copyto(inbound.array, array, casting="no")
        self.finish(inbound)

    # ---- failures ----------------------------------------------------------------------

    def fail(self, exc: BaseException, *, src: int | None = None) -> None:
        """Fail pending receives (all, or only those from ``src``: a receive from any
        source may still be served by another)."""
        for key in list(self._posted):
            if src is None or key[0] == src:
                self._fail_queue(key, exc)
        if src is None:
            for queue in self._wild.values():
                for posted in queue:
                    _fail(posted.future, exc)
            self._wild.clear()

    def poison_group(self, group: int, exc: BaseException) -> None:
        """Fail every pending and later receive of ``group`` with ``exc``."""
        self._group_errors.setdefault(group, exc)
        for key in [k for k in self._posted if k[1].group == group]:
            self._fail_queue(key, self._group_errors[group])
        for tag in [t for t in self._wild if t.group == group]:
            for posted in self._wild.pop(tag):
                _fail(posted.future, self._group_errors[group])

    def group_error(self, group: int) -> BaseException | None:
        return self._group_errors.get(group)

    def _fail_call(self, call: Call, exc: BaseException) -> None:
        for key in [k for k in self._posted if (k[1].group, k[1].seq) == call]:
            self._fail_queue(key, exc)

    def _fail_queue(self, key: Key, exc: BaseException) -> None:
        for posted in self._posted.pop(key, ()):
            self._unlisted(key[1])
            _fail(posted.future, exc)

    # ---- bookkeeping -------------------------------------------------------------------

    def _take_posted(self, key: Key) -> Posted | None:
        queue = self._posted.get(key)
        posted = None
        while queue and posted is None:
            candidate = queue.popleft()
            self._unlisted(key[1])
            if not candidate.future.done():
                posted = candidate
        if queue is not None and not queue:
            del self._posted[key]
        return posted

    def _take_wild(self, tag: Tag) -> Posted | None:
        queue = self._wild.get(tag)
        posted = None
        while queue and posted is None:
            candidate = queue.popleft()
            if not candidate.future.done():
                posted = candidate
        if queue is not None and not queue:
            del self._wild[tag]
        return posted

    def _hold(self, meta: TensorMeta) -> None:
        self.early_bytes += meta.nbytes
        held = self._early_calls.setdefault((meta.tag.group, meta.tag.seq), [meta.src, meta.op, 0])
        held[2] += 1

    def _release(self, meta: TensorMeta, nbytes: int) -> None:
        call = (meta.tag.group, meta.tag.seq)
        held = self._early_calls.get(call)
        if held is not None:
            held[2] -= 1
            if held[2] <= 0:
                del self._early_calls[call]
        was_over = self.over_budget
        self.early_bytes -= nbytes
        if was_over and not self.over_budget:
            self._on_drain()
