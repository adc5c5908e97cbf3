"""The ``Work`` a shardwire collective returns to torch."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardwire.protocol import CollectiveTimeout
from shardwire.protocol.errors import InvalidArgument
from shardwire.torch.loopthread import LoopThread

# A wait with no timeout of its own is still bounded: by the call's own limit (after
# which shardwire fails it with a typed error) plus this much for the error to arrive.
_MARGIN = 30.0


class BridgeWork(dist.Work):
    """A call running on shardwire's loop, as torch's ``Work``.

    ``wait(timeout)`` honours ``timeout`` (a ``CollectiveTimeout`` naming the op when it
    passes; the call itself goes on, so the group stays in step) and raises the call's
    own typed error (``PeerFailed``, say). The future from :meth:`get_future` completes
    with ``result`` once the call has finished and its outputs are in place, or fails
    when the call failed.

    A failed future is failed in torch's C++ terms, not a value: torch's
    ``Future.set_exception`` stores the exception as the future's *value* and only its
    Python ``wait()`` raises it, so C++ readers (DDP's reducer, which reads the value as
    a list of tensors) crash on it. The future torch gets is therefore the child of a
    ``then`` whose callback raises the call's error: C++ marks that child failed, and
    every reader raises, C++ and Python alike (Python's ``wait()`` raises a
    ``RuntimeError`` whose message names the typed error; ``recovering`` finds the
    typed error itself).
    """

    def __init__(
        self,
        engine: LoopThread,
        future: concurrent.futures.Future[Any],
        result: list[torch.Tensor],
        *,
        op: str,
        limit: float,
        source: Callable[[Any], int] | None = None,
    ):
        super().__init__()
        self._source = source  # a receive's sending rank, from the call's result
        self._engine = engine
        self._future = future
        self._result = result
        self._op = op
        self._limit = limit + _MARGIN
        self._lock = threading.Lock()
        self._head: torch.futures.Future[None] | None = None
        self._torch: torch.futures.Future[list[torch.Tensor]] | None = None

    def _settle(self, _future: concurrent.futures.Future[Any]) -> None:
        assert self._head is not None
        self._head.set_result(None)  # runs _outcome, which completes or fails the child

    def _outcome(self, _head: torch.futures.Future[None]) -> list[torch.Tensor]:
        error = _error(self._future)
        if error is not None:
            raise error
        return self._result

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds()
        bound = seconds if seconds > 0 else self._limit
        try:
            self._future.result(bound)
        except TimeoutError:
            if self._future.done():  # the call's own error (CollectiveTimeout is one)
                raise
            if seconds > 0:
                raise CollectiveTimeout(
                    f"{self._op} did not complete within wait(timeout={seconds:g} s)"
                ) from None
            raise CollectiveTimeout(
                f"{self._op}: shardwire's loop gave no answer in {bound:g} s"
            ) from None
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        # Made on first request: a call torch only waits for (most are) then never wakes
        # the completion thread, whose hand-offs cost more than a small collective.
        with self._lock:
            if self._torch is None:
                self._head = torch.futures.Future()
                self._torch = self._head.then(self._outcome)
                if self._future.done():
                    self._settle(self._future)
                else:
                    engine = self._engine
                    self._future.add_done_callback(lambda f: engine.later(self._settle, f))
            return self._torch

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and _error(self._future) is None

    def exception(self) -> BaseException | None:
        return _error(self._future) if self._future.done() else None

    def result(self) -> list[torch.Tensor]:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The group rank a finished receive came from (torch's ``recv(src=None)``)."""
        if self._source is None:
            raise InvalidArgument(f"{self._op} is not a receive: it has no source rank")
        self.wait()
        return self._source(self._future.result())


def _error(future: concurrent.futures.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return concurrent.futures.CancelledError(f"{future} was cancelled")
    return future.exception()
