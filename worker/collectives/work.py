"""What a collective call returns: :class:`Pending`, placed in its group's order when
the call was made, and :class:`Work`, the same call running in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from shardwire.protocol.errors import InvalidState
from shardwire.worker.observe.waits import WAITS, waited

if TYPE_CHECKING:
    from shardwire.worker.backends.base import Decision
    from shardwire.worker.collectives.group import Group

T = TypeVar("T")


class Work(Generic[T]):
    """A collective running in the background (``group.all_gather(x).start()``); owned by
    its group.

    ``await work.wait()`` returns the result (or raises the call's error); ``done()``
    polls; ``cancel()`` aborts it, which poisons the group on every rank (the ranks
    are mid-exchange and cannot agree on where they stopped).
    """

    def __init__(self, task: asyncio.Future[T]):
        self._task = task

    async def wait(self) -> T:
        # shield: a waiter that gives up does not abort the collective; cancel() does.
        if self._task.done():
            return self._task.result()
        with WAITS:
            return await asyncio.shield(self._task)

    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        self._task.cancel()

    async def ended(self) -> None:
        """Return once the call ended, however it ended. Its error is not raised here
        (``wait()`` still raises it) and never logged as unretrieved."""
        await asyncio.wait((self._task,))
        if not self._task.cancelled():
            self._task.exception()


class Pending(Generic[T]):
    """A collective call, placed in its group's order when it was made.

    ``await`` it for the result, or call :meth:`start` to run it in the background and
    get a :class:`Work`; one or the other, once.
    """

    __slots__ = ("_coro", "_group", "_on_start", "_taken", "_value", "decision")

    def __init__(
        self,
        group: Group,
        coro: Coroutine[Any, Any, T] | None,
        on_start: Callable[[], None] | None = None,
        value: Any = None,
        decision: Decision | None = None,
    ):
        self._group = group
        self.decision = decision  # how a collective runs (None: a point-to-point message)
        self._coro = coro  # None: the call already ended, with ``value``
        self._value = value
        self._taken = False
        self._on_start = on_start  # the arena runs a started call on its thread at once

    def _take(self) -> Coroutine[Any, Any, T] | None:
        if self._taken:
            raise InvalidState("this collective call was already awaited or started")
        self._taken = True
        return self._coro

    def __await__(self) -> Generator[Any, None, T]:
        coro = self._take()
        if coro is None:
            return _ended(self._value)
        return waited(coro)

    def start(self) -> Work[T]:
        """Run the call in the background; the group owns it (and cancels it on close)."""
        coro = self._take()
        if coro is None:
            ended: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            ended.set_result(self._value)
            return Work(ended)
        work = self._group.spawn(coro)
        if self._on_start is not None:
            self._on_start()
        return work


def _ended(value: T) -> Generator[Any, None, T]:
    return value
    yield  # a generator that returns at once: awaiting an ended call never suspends
