"""``init()``: join the job and get a process group (the worker's composition root)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from shardwire.protocol import (
    CollectiveTimeout,
    JobAborted,
    LeftJob,
    PeerFailed,
    RecoveryError,
    Token,
)
from shardwire.protocol.auth import check_bind
from shardwire.protocol.errors import blamed_rank, failure_reason
from shardwire.protocol.messages import Abort, Join
from shardwire.protocol.nofile import ensure_nofile
from shardwire.protocol.placement import Member
from shardwire.worker import chaos
from shardwire.worker.collectives.process import ProcessGroup
from shardwire.worker.observe import trace
from shardwire.worker.observe.flight import FlightRecorder
from shardwire.worker.runtime import leave
from shardwire.worker.runtime.launched import check_launched
from shardwire.worker.runtime.liveness import ControlThread
from shardwire.worker.runtime.parent import end_with_parent
from shardwire.worker.runtime.worker_config import WorkerConfig
from shardwire.worker.transport import shm
from shardwire.worker.transport.book import AddressBook
from shardwire.worker.transport.mesh import TcpMesh
from shardwire.worker.transport.mesh_config import MeshConfig

if TYPE_CHECKING:
    from shardwire.worker.chaos.inject import Injector

T = TypeVar("T")

# A survivor re-forming waits this long for the coordinator to end the generation (it
# learns of a peer's death from its link at times before the coordinator does)
_END_WAIT = 60.0

# A rank that gave up on a collective waits this long for the coordinator's verdict (it
# asks every rank what it was doing) before it closes its connections: closing them
# first would make the others blame it.
_VERDICT_WAIT = 10.0


def mesh_config(cfg: WorkerConfig, *, run_id: str, token: Token) -> MeshConfig:
    """The peer mesh's settings from a worker's (``run_id`` names its shared memory;
    ``token`` authenticates its connections)."""
    tls = cfg.tls
    return MeshConfig(
        run_id=run_id,
        token=token,
        bind_host=cfg.bind_host,
        listen_ports=cfg.peer_ports,
        connect_timeout=cfg.connect_timeout,
        idle_close=cfg.idle_close,
        checksum=cfg.checksum,
        shm=cfg.transport == "auto",
        shm_slots=cfg.shm_slots,
        shm_slot_bytes=cfg.shm_slot_bytes,
        busy_poll_us=cfg.busy_poll_us,
        arena=cfg.transport == "auto",
        arena_slot_bytes=cfg.arena_slot_bytes,
        arena_peer_reads=cfg.arena_peer_reads,
        tcp_congestion=cfg.tcp_congestion,
        tcp_notsent_lowat=cfg.tcp_notsent_lowat,
        tls_server=tls.server_context() if tls else None,
        tls_client=tls.client_context() if tls else None,
    )


class Session:
    """Async context manager returned by :func:`init`.

    Entering joins the job and builds the peer mesh; leaving tells the coordinator how
    this process ended (cleanly, or with the exception and its traceback) and releases
    every socket and task, whatever happened.
    """

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.group: ProcessGroup | None = None
        self._mesh: TcpMesh | None = None
        self._control: ControlThread | None = None
        self._rank = -1
        self._chaos: Injector | None = None  # a chaos plan's faults for this rank
        self._parent = os.getppid()  # under a node agent: the agent or its fork server
        self._leave: leave.LeaveNotice | None = None  # SIGTERM as a notice to leave
        self._reforming = False  # joins after the first are re-formations (live recovery)

    async def __aenter__(self) -> ProcessGroup:
        if self.config.agent_beats:  # under a node agent: a rank does not outlive it
            end_with_parent(self._parent)
        try:
            return await self._start()
        except BaseException:
            await self._release()
            raise

    @property
    def live(self) -> bool:
        """Whether the job recovers live (``--recovery live``): a survivor of another
        rank's failure re-forms with :meth:`reform` rather than exiting."""
        return self.config.recovery == "live"

    def leave_notice(self, *, grace: float = leave.GRACE_S) -> leave.LeaveNotice:
        """Take SIGTERM as a notice to leave (live recovery): give the notice to
        ``PeerCopies(leave=...)``, whose next copy step hands this rank's state to its
        holder and ends the rank with ``LeftJob``; its replacement resumes from that
        step. With no copy step within ``grace`` seconds, SIGTERM ends the process as
        before. One notice per process, kept across re-formations.

        Raises:
            RecoveryError: the job does not recover live (``--recovery live``).
        """
        if not self.live:
            raise RecoveryError("a SIGTERM notice to leave needs live recovery (--recovery live)")
        if self._leave is None:
            self._leave = leave.LeaveNotice(self._rank, grace=grace)
            self._leave.arm()
        return self._leave

    async def recovering(self, train: Callable[[ProcessGroup], Awaitable[T]]) -> T:
        """Run ``train(group)`` on this generation's group; with live recovery, when a
        rank's failure ends the generation (``PeerFailed``), re-form (:meth:`reform`) and
        run it again on the next generation's group, until it returns. ``train`` builds
        what it needs on the group it is given and restores the state (from peer
        copies or a checkpoint) before it trains. Without live recovery the error
        propagates, as from ``train`` itself."""
        if self.group is None:
            raise RecoveryError("recovering() is for a session that joined its job")
        group = self.group
        while True:
            try:
                return await train(group)
            except PeerFailed as error:
                if not self.live:
                    raise
                group = await self.reform(error)

    async def reform(self, error: BaseException | None = None) -> ProcessGroup:
        """Leave the generation another rank's failure ended and join the next one, in
        this process (``--recovery live``); returns the new generation's group.

        Call it where a collective raised ``PeerFailed`` (or ``JobAborted``), with that
        error. The peer mesh, the node arena and the coordinator connection are made
        anew, and this process keeps its rank; the old group and whatever was built on
        it (an FSDP wrapper, subgroups) must not be used again: build them on the new
        group and restore the training state (``FSDP.load``, or a peer's copy).

        Raises:
            RecoveryError: the job was not launched with live recovery; or it is over (no
                restart left, or the coordinator gave no word within a minute); or this
                rank is the one that failed, or its node agent is gone.
        """
        if not self.live:
            raise RecoveryError(
                "re-forming in the process needs live recovery: launch with --recovery live"
            )
        control = self._control
        if control is None or self.group is None:
            raise RecoveryError("reform() is for a session that joined its job")
        if isinstance(error, PeerFailed) and 0 <= error.rank != self._rank:
            control.report_peer_failure(error.rank, error.reason)  # not this rank's fault
        verdict = await control.wait_verdict(_END_WAIT)
        if verdict is None:
            raise RecoveryError(
                f"rank {self._rank}: no word from the coordinator within {_END_WAIT:g} s "
                "that the job goes on"
            ) from error
        # the kernel ends a rank with its agent (end_with_parent); where it could not
        if self.config.agent_beats and os.getppid() != self._parent:
            raise RecoveryError(
                f"rank {self._rank}: its node agent is gone (its node left the job): it does "
                "not re-form; the node's ranks start anew with its next agent"
            ) from error
        if verdict.rank == self._rank:
            raise RecoveryError(
                f"rank {self._rank} is the rank that failed ({verdict.reason}): it does not "
                "re-form; its node agent replaces it"
            ) from error
        if not verdict.restarting:
            raise RecoveryError(
                f"the job is over: rank {verdict.rank} failed ({verdict.reason}) and no "
                "restart is left"
            ) from error
        if self._chaos is not None:
            self._chaos.close()
        await self._release()
        self.group = self._mesh = self._control = self._chaos = None
        # the next generation's number is learned from the placement
        self.config = dataclasses.replace(self.config, generation=0)
        self._reforming = True
        try:
            return await self._start()
        except BaseException:
            await self._release()
            raise

    async def _start(self) -> ProcessGroup:
        cfg = self.config
        check_bind(cfg.bind_host, cfg.token, insecure=cfg.insecure, what="peer listener")
        # a connection (and at times a shared-memory segment) per peer, plus room
        ensure_nofile(2 * cfg.world_size + 64, f"a worker of a {cfg.world_size}-rank job")
        mesh = self._mesh = TcpMesh(
            mesh_config(cfg, run_id=cfg.run_id, token=cfg.token),
            timeout=cfg.timeout,
            on_peer_failed=self._peer_failed,
        )
        port = await mesh.listen(first=cfg.local_rank)
        recorder = FlightRecorder()
        tls = cfg.tls
        control = self._control = ControlThread(
            token=cfg.token,
            run_id=cfg.run_id,
            heartbeat_interval=cfg.heartbeat_interval,
            stall_warn=cfg.stall_warn,
            recorder=recorder,
            on_abort=self._aborted,
            on_coordinator=self._coordinator_away,
            tls=tls.client_context() if tls else None,
            generation=cfg.generation,
            links=mesh.traffic.report,
        )
        # under a node agent (which always gives the rank): heartbeats batched per node
        relay = None
        if cfg.agent_beats and cfg.rank is not None:
            relay = (cfg.agent_beats, cfg.rank, cfg.generation)
        await control.connect(
            *cfg.coordinator,
            timeout=cfg.join_timeout,
            relay=relay,
            replicas=cfg.coordinator_replicas,
        )
        place = await control.join(
            Join(
                world_size=cfg.world_size,
                node_id=cfg.node_id,
                local_rank=cfg.local_rank,
                local_world_size=cfg.local_world_size,
                listen_host=cfg.advertise_host,
                listen_port=port,
                requested_rank=cfg.rank,
                reforming=self._reforming,
            ),
            timeout=cfg.join_timeout,
        )
        self._rank = place.rank
        control.placed(place.generation)
        if cfg.trace and trace.current() is None:  # every rank's events on the coordinator's clock
            offset, error = await control.clock_offset()
            trace.install(trace.Tracer(place.rank, Path(cfg.trace), offset=offset, error=error))
        lookup_timeout = cfg.connect_timeout

        async def lookup(ranks: list[int]) -> list[Member]:
            return await control.peers(ranks, timeout=lookup_timeout)

        mesh.start(place, AddressBook(lookup))
        self.group = ProcessGroup(
            mesh,
            local_rank=place.local_rank,
            local_world_size=place.local_world_size,
            node_rank=place.node_rank,
            generation=place.generation,
            timeout=cfg.timeout,
            progress=control.set_progress,
            interactive=cfg.interactive,
            recorder=recorder,
        )
        self._chaos = chaos.injector(os.environ, self.group)
        return self.group

    def _peer_failed(self, error: PeerFailed) -> None:
        if self._chaos is not None:
            self._chaos.noticed(error)
        if self._control is not None:
            self._control.report_peer_failure(error.rank, error.reason)

    def _coordinator_away(self, away: bool, at: float) -> None:
        if self._chaos is not None:
            self._chaos.coordinator(away=away, at=at)

    def _aborted(self, msg: Abort | None) -> None:
        if self._mesh is None:
            return
        error: JobAborted | PeerFailed
        hang_up: PeerFailed | None = None  # what the peers hear, if not ``error``
        if msg is None:
            host, port = self.config.coordinator
            error = JobAborted(f"lost the coordinator at {host}:{port}")
        elif msg.rank == self._rank:
            error = JobAborted(f"stopped by the coordinator: {msg.reason}")
            if msg.restarting:
                # the job goes on without this process: its peers, hearing from it as it
                # hangs up, learn of this rank's failure (and re-form), not of a job stopped
                hang_up = PeerFailed(rank=msg.rank, reason=msg.reason)
        else:
            error = PeerFailed(rank=msg.rank, reason=msg.reason, remote_traceback=msg.traceback)
        if self._chaos is not None:
            self._chaos.noticed(error)
        self._mesh.abort(hang_up or error)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._chaos is not None:
            self._chaos.ended(exc)
        if self.live and type(exc) is PeerFailed:
            print(
                f"shardwire: rank {self._rank} ends with {exc.__class__.__name__} although the "
                "job recovers live: a script re-forms in its process by catching the error "
                "and calling `pg = await session.reform(error)`; its node agent starts this "
                "rank anew instead",
                file=sys.stderr,
                flush=True,
            )
        tracer = trace.current()
        if tracer is not None:
            trace.install(None)
            await asyncio.to_thread(tracer.write)
            if exc is None and self.group is not None:
                await self.group.barrier()  # every rank's file is written
                if self.group.rank == 0:
                    await asyncio.to_thread(trace.merge, tracer.directory)
        if self._control is not None:
            if exc is None:
                self._control.leave()
            elif 0 <= (blamed := blamed_rank(exc)) != self._rank:
                # a survivor names the rank it saw fail (or whose error a collective
                # relayed to it) before its own connection closes: the coordinator must
                # take neither that close nor the relayed error for the root cause
                self._control.report_peer_failure(blamed, failure_reason(exc))
            elif isinstance(exc, LeftJob):  # a planned leave: its words, no traceback
                self._control.report_failure(str(exc), "")
            elif not isinstance(exc, JobAborted):  # a survivor is not the root cause
                await self._report(exc, "".join(traceback.format_exception(exc_type, exc, tb)))
        await self._release()
        if self._leave is not None:
            self._leave.disarm()
        if exc is not None and not self.live:
            # The job is over (a failure stops every rank; under live recovery it goes
            # on, and the agents sweep at its end). A rank killed while it offered
            # a shared-memory region to this node's others left its name behind; no node
            # agent may be there to remove it (ranks a scheduler started directly).
            shm.sweep(self.config.run_id)

    async def _report(self, exc: BaseException, text: str) -> None:
        assert self._control is not None
        if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
            self._control.report_failure("interrupted (its main task was cancelled)", "")
            return
        reason = failure_reason(exc)
        # A timed-out collective names no culprit by itself: the coordinator asks every
        # rank for its flight recorder and stack, and this rank waits for that verdict.
        hang = isinstance(exc, CollectiveTimeout) and self.group is not None
        self._control.report_failure(
            reason,
            text,
            code="collective_timeout" if hang else "",
            diagnosis=self._control.diagnosis() if hang else None,
        )
        if self._mesh is not None:
            self._mesh.report_failure(reason, text)
        if hang:
            await self._control.wait_verdict(_VERDICT_WAIT)

    async def _release(self) -> None:
        if self.group is not None:
            await self.group.aclose()
        if self._mesh is not None:
            await self._mesh.aclose()
        if self._control is not None:
            await self._control.aclose()


def init(config: WorkerConfig | None = None) -> Session:
    """Join the job; use as ``async with shardwire.worker.init() as pg:``.

    Args:
        config: explicit settings; by default they are read from the environment the
            launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
            ``MASTER_ADDR``, ``MASTER_PORT``, ``SHARDWIRE_*``).

    Raises:
        NotLaunched: no launcher started this process (and no ``config`` was given).
        RendezvousError: the coordinator refused the join (the message says why).
        AuthFailed: the token does not match the coordinator's.
    """
    if config is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
        check_launched(os.environ, script)
        config = WorkerConfig.from_env(os.environ)
    return Session(config)
