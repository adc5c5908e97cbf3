"""The process's shardwire backend, as torch's registries reach it.

torch keeps its backends and rendezvous handlers in process-wide registries and calls
them back from ``init_process_group`` and ``new_group``; :class:`Bridge` is the one
object those callbacks reach (the package creates it on import). It owns the engine
(shardwire's loop thread) and the mesh the process joined, and leaves the job when the
default group is destroyed or the process exits: cleanly, or naming the exception the
process died of, so the launcher's summary names this rank and its error.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from shardwire.protocol import PeerFailed, ShardwireError
from shardwire.protocol.errors import InvalidState, LeftJob, RecoveryError
from shardwire.torch.group import ShardwireProcessGroup
from shardwire.torch.join import Joined, through_coordinator, through_store
from shardwire.torch.loopthread import LoopThread
from shardwire.torch.store import JobStore
from shardwire.worker.collectives import Group
from shardwire.worker.runtime.leave import GRACE_S, LeaveNotice
from shardwire.worker.runtime.worker_config import WorkerConfig

# Variables only shardwire's launcher (or a user joining a shardwire job) sets.
_JOB_MARKERS = ("SHARDWIRE_RUN_ID", "SHARDWIRE_TOKEN", "SHARDWIRE_TOKEN_FILE")
_CLOSE_TIMEOUT = 60.0


def rendezvous_handlers() -> dict[str, Any]:
    """torch's table of rendezvous handlers by scheme (the module, not the function
    ``torch.distributed.rendezvous`` that shadows its name)."""
    module = importlib.import_module("torch.distributed.rendezvous")
    handlers: dict[str, Any] = module._rendezvous_handlers
    return handlers


class Bridge:
    """Creates torch process groups over shardwire and owns what they run on."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = environ
        self._lock = threading.RLock()
        self._engine: LoopThread | None = None
        self._joined: Joined | None = None
        self._failure: BaseException | None = None
        self._reforming = False  # the default group's shutdown then does not leave the job
        self._leave: LeaveNotice | None = None  # SIGTERM as a notice, once armed
        self._torch_env = rendezvous_handlers()["env"]

    @property
    def in_job(self) -> bool:
        """Whether this process was started as a worker of a shardwire job."""
        return any(self._environ.get(k) for k in _JOB_MARKERS)

    @property
    def live(self) -> bool:
        """Whether the job recovers live (``--recovery live``): a survivor of another
        rank's failure re-forms in its process (:meth:`reform`)."""
        return self.in_job and self._config().recovery == "live"

    def _config(self) -> WorkerConfig:
        return WorkerConfig.from_env(self._environ)

    # ---- live recovery -----------------------------------------------------------------

    def leave_notice(self, *, grace: float = GRACE_S) -> LeaveNotice:
        """Take SIGTERM as a notice to leave (live recovery): give it to
        ``PeerStorage(leave=...)``, whose ``leaving()`` then tells every rank to save
        and whose ``leave()`` ends this rank with ``LeftJob`` once its part is at its
        holder. With no hand-over within ``grace`` seconds SIGTERM ends the process as
        before. One notice per process, kept across re-formations; call it on the main
        thread.

        Raises:
            RecoveryError: the job does not recover live (``--recovery live``).
            InvalidState: called off the main thread (signals are taken there only).
        """
        if not self.live:
            raise RecoveryError("a SIGTERM notice to leave needs live recovery (--recovery live)")
        if self._leave is None:
            joined = self._joined
            rank = joined.world.rank if joined is not None else self._config().rank or 0
            notice = LeaveNotice(rank, grace=grace, point="its next PeerStorage.leaving()")
            if not notice.arm():
                raise InvalidState("leave_notice() takes SIGTERM: call it on the main thread")
            self._leave = notice
        return self._leave

    def reform(self, error: BaseException) -> None:
        """Leave the generation a peer's failure ended and join the next one in this
        process: torch's process groups are destroyed (the job is not left) and the
        default group is created again on the new generation (``init_process_group``),
        with this rank's place in it. What was built on the old groups (an FSDP2 model,
        its optimizer, subgroups) must be built anew and its state restored.

        Raises:
            RecoveryError: this process did not join a shardwire job through the
                launcher (torch's store has no next generation), or the session refused
                (no live recovery, no restart left, this rank is the one that failed).
        """
        with self._lock:
            joined, engine = self._joined, self._engine
            if joined is None or engine is None:
                raise RecoveryError("reform() is for a process in a shardwire job's group")
            if joined.reform is None:
                raise RecoveryError(
                    "re-forming in the process needs a job started by shardwire's launcher "
                    "(with --recovery live); this group met through torch's store"
                )
            self._reforming = True
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            new = engine.run(joined.reform(error), self._config().join_timeout + 120)
        finally:
            self._reforming = False
        with self._lock:
            self._joined = new
        dist.init_process_group("shardwire")

    def peer_failure(self, error: BaseException) -> PeerFailed | None:
        """The peer's failure behind ``error``, if a peer's failure ended this process's
        generation: ``error`` itself or what it was raised from, or else the failure the
        job's world group holds. torch's C++ readers of a failed future (DDP's reducer
        in ``backward()``) raise a ``RuntimeError`` that only names the typed error."""
        seen: BaseException | None = error
        for _ in range(16):  # a chain of causes is short; a cycle is not followed
            if seen is None:
                break
            if isinstance(seen, PeerFailed):
                return seen
            # DCP's CheckpointException keeps each rank's error in ``failures``
            for wrapped in getattr(seen, "failures", {}).values():
                inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
                if isinstance(inner, PeerFailed):
                    return inner
            seen = seen.__cause__ or seen.__context__
        with self._lock:
            joined, engine = self._joined, self._engine
        if joined is None or engine is None:
            return None
        world = joined.world

        async def held() -> BaseException | None:
            return world.failed_now()

        failure = engine.run(held(), _CLOSE_TIMEOUT)
        return failure if isinstance(failure, PeerFailed) else None

    # ---- torch's callbacks -------------------------------------------------------------

    def env_rendezvous(
        self, url: str, timeout: timedelta | None = None, **kwargs: Any
    ) -> Iterator[tuple[dist.Store, int, int]]:
        """``env://``: inside a shardwire job, join it through the coordinator (torch's
        variables there name the coordinator, not a TCPStore); elsewhere torch's own."""
        if not self.in_job:
            yield from self._torch_env(url, **({"timeout": timeout} if timeout else {}), **kwargs)
            return
        joined = self._join_job()
        yield JobStore(), joined.world.rank, joined.world.size
        raise InvalidState("the shardwire backend cannot re-rendezvous through env://")

    def create(self, opts: Any, _backend_options: Any = None) -> ShardwireProcessGroup:
        """torch's backend creator (``extended_api``): a group over the joined mesh."""
        with self._lock:
            ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
            if self._joined is None:
                if self.in_job:
                    self._join_job()
                else:
                    self._join_store(opts, ranks)
            joined = self._joined
            assert joined is not None and self._engine is not None
            group = self._group_for(joined, ranks, str(opts.group_id))
            limit = self._limit(opts.timeout)
            if group is joined.world:
                return ShardwireProcessGroup(
                    self._engine, group, timeout=limit, on_shutdown=self.close
                )
            engine = self._engine

            def close_group() -> None:
                if self._engine is engine:  # after the world's shutdown there is nothing left
                    engine.run(group.aclose(), _CLOSE_TIMEOUT)

            return ShardwireProcessGroup(engine, group, timeout=limit, on_shutdown=close_group)

    def _limit(self, timeout: timedelta | None) -> float:
        """A group's time limit per collective: the ``timeout`` given to
        ``init_process_group``/``new_group`` when it is not torch's default (30 minutes,
        too long to wait for a dead peer's verdict), else ``SHARDWIRE_TIMEOUT``."""
        if timeout is None or timeout == default_pg_timeout or timeout.total_seconds() <= 0:
            return self._config().timeout
        return timeout.total_seconds()

    # ---- joining -----------------------------------------------------------------------

    def _start_engine(self) -> LoopThread:
        if self._engine is None:
            engine = LoopThread()
            engine.start()
            self._engine = engine
            # before the interpreter stops its executors (leaving uses one), not at atexit
            threading._register_atexit(self.close)  # type: ignore[attr-defined]
            previous = sys.excepthook

            def excepthook(
                kind: type[BaseException], error: BaseException, tb: TracebackType | None
            ) -> None:
                self._failure = error
                if isinstance(error, LeftJob):  # a planned leave: its words, no traceback
                    print(f"shardwire: {error}", file=sys.stderr, flush=True)
                    return
                previous(kind, error, tb)

            sys.excepthook = excepthook
        return self._engine

    def _join_job(self) -> Joined:
        with self._lock:
            if self._joined is None:
                config = self._config()
                engine = self._start_engine()
                self._joined = engine.run(through_coordinator(config), config.join_timeout + 60)
            return self._joined

    def _join_store(self, opts: Any, ranks: list[int]) -> Joined:
        config = self._config()
        engine = self._start_engine()
        coro = through_store(
            opts.store, rank=opts.group_rank, size=opts.group_size, ranks=ranks, config=config
        )
        self._joined = engine.run(coro, opts.timeout.total_seconds() + 60)
        return self._joined

    def _group_for(self, joined: Joined, ranks: list[int], name: str) -> Group:
        if ranks == joined.ranks:
            return joined.world
        where = {g: i for i, g in enumerate(joined.ranks)}
        missing = [g for g in ranks if g not in where]
        if missing:
            raise ShardwireError(
                f"ranks {missing} of group {name!r} are not in the shardwire job this "
                f"process joined ({len(joined.ranks)} ranks); create the default group with "
                "backend 'shardwire' first"
            )
        world = joined.world
        members = [where[g] for g in ranks]

        async def make() -> Group:
            return world.new_group(members, name=name)

        assert self._engine is not None
        return self._engine.run(make(), 60.0)

    # ---- leaving -----------------------------------------------------------------------

    def close(self) -> None:
        """Leave the job (reporting the exception the process dies of, if any) and stop
        the engine. Runs at exit; safe to call more than once. Not while re-forming: the
        default group's shutdown then only ends torch's use of it."""
        with self._lock:
            if self._reforming:
                return
            engine, joined = self._engine, self._joined
            self._engine = self._joined = None
        if engine is None:
            return
        try:
            if joined is not None:
                engine.run(joined.close(self._failure), _CLOSE_TIMEOUT)
        finally:
            engine.close()
