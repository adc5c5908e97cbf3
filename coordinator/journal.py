"""The coordinator's journal: what a restarted coordinator needs to resume a running job.

A coordinator given ``--state-dir`` writes, whenever a generation forms or ends, the
running generation's members (each worker's join, address and rank), its node agents
(their joins and node ranks), the generation number and the restarts used (and, from
the moment the nodes of a forming generation are assigned until it runs, that
generation with its nodes and no workers; between generations, the restart the agents
were told of), to
``journal.json`` in that directory: a temporary file, flushed to disk, then renamed over
the old one, so a reader finds the whole old journal or the whole new one. Heartbeats and
progress are never journaled: they change every second and a restarted coordinator
learns them again within one. A coordinator started on a directory with a journal of its
run resumes that generation (``recovery.py``).

The directory is held with an exclusive lock (``lock``, which names the holder's PID and
host) for as long as the coordinator runs: two live coordinators never write one journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from pathlib import Path
from typing import Literal, Protocol

from pydantic import ValidationError

from shardwire.protocol.errors import ShardwireError
from shardwire.protocol.fields import Msg, Rank, Size, Str
from shardwire.protocol.messages import Join, NodeJoin, Restart


class StateDirError(ShardwireError, RuntimeError):
    """A state directory the coordinator cannot use: not writable, held by another live
    coordinator, or holding another run's journal."""


class Deposed(ShardwireError):
    """A journal write was refused because this coordinator no longer leads its run (a
    replica elected in its place writes the journal now)."""


class JournalWorker(Msg):
    rank: Rank
    host: Str
    join: Join


class JournalNode(Msg):
    node_rank: Rank
    join: NodeJoin


class JournalEra(Msg):
    """One generation of the job's history, as of the journal's writing."""

    generation: int
    world_size: Size
    nodes: int
    started_ago_s: float  # before the journal was written
    duration_s: float | None = None
    ended_by: Str = ""


class Journal(Msg):
    """A running generation, as a restarted coordinator resumes it."""

    kind: Literal["shardwire-coordinator-journal-1"] = "shardwire-coordinator-journal-1"
    run_id: Str
    generation: int
    restarts: int
    max_restarts: int
    world_size: Size
    local_world_size: Size
    min_nodes: int = 0
    forming: bool = False  # the nodes were assigned, the workers not placed yet (none here)
    written_at: float = 0.0  # wall clock, seconds since the epoch (0: not said)
    # between generations: the restart the agents were told of, and the agents, whose
    # NodeJoin for the next generation is awaited (then ``generation`` is that one)
    restart: Restart | None = None
    rejoining: list[NodeJoin] = []
    history: list[JournalEra] = []  # the generations so far, the newest last
    workers: list[JournalWorker]
    nodes: list[JournalNode]


class JournalStore(Protocol):
    """Where a coordinator keeps its journal: a state directory, or etcd."""

    where: str  # said in messages

    def read(self) -> Journal | None: ...

    def write(self, journal: Journal) -> None: ...

    def remove(self) -> None: ...


def parse_journal(text: str, run_id: str, where: str) -> Journal:
    """The journal ``text`` read from ``where`` holds, if it is run ``run_id``'s."""
    try:
        journal = Journal.model_validate_json(text)
    except ValidationError as exc:
        raise StateDirError(
            f"{where} is not a coordinator journal this version reads: {exc.errors()[0]['msg']}"
        ) from None
    if journal.run_id != run_id:
        raise StateDirError(
            f"{where} holds run {journal.run_id!r}'s journal, not {run_id!r}'s: give each "
            "run its own state"
        )
    return journal


class StateDir:
    """A coordinator's state directory: locked while open; the journal read and written."""

    def __init__(self, path: str | Path, run_id: str) -> None:
        self.path = Path(path)
        self.run_id = run_id
        self.where = str(self.path)
        self._lock: int | None = None

    @property
    def journal_path(self) -> Path:
        return self.path / "journal.json"

    def open(self) -> None:
        """Take the directory (made if missing): refused if it is not writable or another
        live coordinator holds it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateDirError(f"state directory {self.path} is not usable: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"state directory {self.path} is held by another live coordinator ({holder}); "
                "stop it, or give this one a directory of its own"
            ) from None
        me = f"PID {os.getpid()} on {socket.gethostname()}".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        self._lock = fd
        probe = self.path / ".writable"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.close()
            raise StateDirError(f"state directory {self.path} is not writable: {exc}") from exc

    def read(self) -> Journal | None:
        """The journal of this run, or None where there is none."""
        try:
            text = self.journal_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateDirError(f"cannot read {self.journal_path}: {exc}") from exc
        return parse_journal(text, self.run_id, str(self.journal_path))

    def write(self, journal: Journal) -> None:
        """Replace the journal, whole (flushed to disk before it is renamed into place)."""
        partial = self.path / ".journal.json.partial"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(journal.model_dump_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.journal_path)
        self._sync_dir()

    def remove(self) -> None:
        """The job is over: no journal to resume from."""
        with contextlib.suppress(FileNotFoundError):
            self.journal_path.unlink()
        self._sync_dir()

    def _sync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the lock
            self._lock = None
