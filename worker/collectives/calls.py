"""How a group runs its calls and fails: deadlines, the calls under way, and the error
each way of failing becomes.

A call that fails (its deadline passed, a peer sent different data, it was cancelled,
a peer died) *poisons* its group: the error is relayed to the other members
(``Transport.poison_group``), and every later call of the group raises it. A call whose
deadline passes says which ranks it still waits for; when it waits for none, the error a
peer ended one of its phases with, which had not reached it yet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from shardwire.protocol import (
    CollectiveCancelled,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    IntegrityError,
    MessageMismatch,
    ShardwireError,
    TransportClosed,
)
from shardwire.worker.backends.base import Backend, Decision, Subgroup
from shardwire.worker.backends.call import Call
from shardwire.worker.collectives.deadlines import Deadlines
from shardwire.worker.transport.base import TransportTimeout

if TYPE_CHECKING:
    from shardwire.worker.collectives.group import Group

T = TypeVar("T")


class Calls:
    """The running calls of one group, and the error that poisoned it."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.error: BaseException | None = None
        self.live: dict[int, Call] = {}  # calls under way, by sequence number
        self.deadlines = Deadlines()
        # the error of the parent's call whose deadline is cancelling this group's calls:
        # what they tell their peers instead of "cancelled"
        self.expiring: BaseException | None = None
        self._expired: dict[int, BaseException] = {}  # why calls passed their deadlines

    async def run(
        self,
        call: Call,
        algorithm: Callable[[Call], Awaitable[T]],
        limit: float,
        nbytes: int,
        *,
        decision: Decision,
        backend: Backend,
    ) -> T:
        g = self.group
        op = call.signature.split(":", 1)[0]
        what = f"{op} #{call.seq}"
        me = g.transport.rank
        entry = g.recorder.begin(
            group=g.group_id,
            ranks=g.ranks,
            op=op,
            seq=call.seq,
            nbytes=nbytes,
            pending=call.silent_ranks,
            path=decision.backend,
        )
        outcome, expired = "error", False
        self.deadlines.watch(call.seq, limit, lambda: self._expire(call, what, limit, backend))
        self.live[call.seq] = call
        try:
            try:
                result = await algorithm(call)
            finally:
                expired = self.deadlines.release(call.seq)
                del self.live[call.seq]
                timed_out = self._expired.pop(call.seq, None)
            g.pool.give(call.taken)
            outcome = "ok"
            return result
        except (TimeoutError, TransportTimeout, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not expired:
                outcome = "cancelled"
                self.poison(
                    self.expiring or CollectiveCancelled(f"{what} was cancelled on rank {me}")
                )
                raise
            outcome = "timeout"
            self.poison(timed_out or self._timed_out(call, what, limit, backend))
        except IntegrityError as exc:  # seen here first when not relayed
            if exc.peer >= 0:
                self.poison(exc)
            self.error = self.error or exc
        except CollectiveError as exc:  # relayed by a peer that failed first
            self.error = self.error or exc
        except MessageMismatch as exc:
            self.poison(CollectiveMismatch(f"{what} on rank {me}: {exc}"))
        except (ShardwireError, OSError) as exc:  # PeerFailed, JobAborted, closed
            self.error = self.error or exc
        finally:
            if outcome == "error":
                outcome = f"error: {type(self.error).__name__}"
            silent = call.silent_ranks() if outcome != "ok" else ()  # the hot path skips it
            call.waits()
            g.recorder.end(entry, outcome, silent=silent, split=call.split)
            if outcome != "ok" and self.error is not None:
                backend.poison(self.error)  # wakes the ranks of this node at once
        assert self.error is not None
        raise self.error

    def _expire(self, call: Call, what: str, limit: float, backend: Backend) -> None:
        """``call`` passed its deadline: note why before the cancellation unwinds the
        calls of subgroups, and have those tell their peers the same."""
        subgroups = backend.subgroups()
        call.stalled.extend(r for s in subgroups for r in s.silent_now())
        error = self._expired[call.seq] = self._timed_out(call, what, limit, backend)
        for group in subgroups:
            group.expiring = error

    def _timed_out(self, call: Call, what: str, limit: float, backend: Backend) -> BaseException:
        """Why ``call`` did not end in time: the ranks it waits for; else the error a
        peer ended one of its phases with that had not reached it yet."""
        waiting = call.silent_ranks()
        if not waiting:
            others: Sequence[Subgroup] = backend.subgroups()
            relayed = (
                _failure(call)
                or self.failed_now()
                or next((e for g in others if (e := g.failed_now())), None)
            )
            if relayed is not None:
                return relayed
        heard = f"not heard from ranks {waiting}" if waiting else "stuck sending"
        me = self.group.transport.rank
        return CollectiveTimeout(f"{what} timed out after {limit:g} s on rank {me}: {heard}")

    def failed_now(self) -> BaseException | None:
        """The error the group failed with, or that a peer ended a call under way with."""
        if self.error is not None:
            return self.error
        return next((e for call in self.live.values() if (e := _failure(call))), None)

    def silent_now(self) -> list[int]:
        """Global ranks the calls under way are waiting for."""
        return sorted({r for call in self.live.values() for r in call.silent_ranks()})

    def poison(self, error: BaseException) -> None:
        """The group failed with ``error`` (unless it already had): tell its members."""
        if self.error is None:
            self.error = error
        g = self.group
        with contextlib.suppress(TransportClosed):
            g.transport.poison_group(g.group_id, self.error, g.ranks)


def _failure(call: Call) -> BaseException | None:
    """The error a peer ended a wait of ``call`` with that had not reached it yet."""
    return next((e for f in call.failures if (e := f()) is not None), None)
