"""Shared-memory segments that carry payload bytes between two ranks on one host.

Theory of operation
-------------------
For each direction between two same-host peers the *sender* creates one segment in
``/dev/shm``: a 4 KiB header page (magic and a random nonce) and ``slots`` slots of
``slot_bytes`` each. Its name is ``shardwire-<hash of the run id>-<32 random hex
digits>``: unguessable, and tied to the run so a node agent can sweep what its workers
left. It is created exclusively with mode 0600 and its pages are reserved up front
(``posix_fallocate``), so a full ``/dev/shm`` is an error at creation (the pair then
stays on TCP), never a SIGBUS later.

The sender offers the segment over the peer connection (name, geometry, nonce). The
receiver attaches only if the file is a regular file of this user, mode 0600, of the
offered size, holding the offered nonce: containers with separate ``/dev/shm`` fail that
check and the pair stays on TCP. Once the receiver has accepted, the sender unlinks the
name, so after that point nothing is left behind by any exit, SIGKILL included.

The connection keeps carrying every frame: a payload's data frame announces the message
(``shm`` in its meta, no payload bytes); each chunk is copied into a free slot and
announced by a small frame naming slot and length; the receiver copies it out into the
destination and returns the slot with a credit frame. Slots and lengths are checked like
frame lengths, so a peer can never make a rank read or write outside a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections import deque
from pathlib import Path

from shardwire.protocol import ProtocolError
from shardwire.worker.transport.shmfiles import (
    SHM_DIR,
    attach_mapped,
    create_mapped,
    left_behind,
    owner_tag,
    run_prefix,
    segment_names,
    sweep,
)

__all__ = [
    "SHM_DIR",
    "Segment",
    "SlotPool",
    "left_behind",
    "owner_tag",
    "run_prefix",
    "segment_names",
    "sweep",
]

HEADER_BYTES = 4096
MAGIC = b"SWSHM001"


class Segment:
    """One mapped segment: a header page and ``slots`` slots of ``slot_bytes``."""

    def __init__(self, path: Path, mapping: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.path = path
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._map: mmap.mmap | None = mapping
        self._view = memoryview(mapping)

    @staticmethod
    def size_for(slots: int, slot_bytes: int) -> int:
        return HEADER_BYTES + slots * slot_bytes

    @classmethod
    def create(
        cls, run_id: str, slots: int, slot_bytes: int, directory: Path = SHM_DIR
    ) -> tuple[Segment, bytes]:
        """A new segment and its nonce; raises OSError if it cannot be made."""
        size = cls.size_for(slots, slot_bytes)
        path, mapping, nonce = create_mapped(run_id, size, MAGIC, directory)
        return cls(path, mapping, slots, slot_bytes), nonce

    @classmethod
    def attach(
        cls,
        run_id: str,
        name: str,
        *,
        slots: int,
        slot_bytes: int,
        nonce: bytes,
        directory: Path = SHM_DIR,
    ) -> Segment:
        """Map a peer's segment after checking it is the one offered (OSError or
        ProtocolError if not)."""
        size = cls.size_for(slots, slot_bytes)
        path, mapping = attach_mapped(
            run_id, name, size, magic=MAGIC, nonce=nonce, directory=directory
        )
        return cls(path, mapping, slots, slot_bytes)

    def slot(self, index: int, length: int) -> memoryview:
        """The first ``length`` bytes of slot ``index`` (both checked)."""
        if not (type(index) is int and 0 <= index < self.slots):
            raise ProtocolError(f"shared-memory slot {index!r} outside 0..{self.slots - 1}")
        if not (type(length) is int and 0 < length <= self.slot_bytes):
            raise ProtocolError(f"shared-memory chunk of {length!r} bytes (slot {self.slot_bytes})")
        start = HEADER_BYTES + index * self.slot_bytes
        return self._view[start : start + length]

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def close(self) -> None:
        if self._map is None:
            return
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a slot view is still in use: unmapped when it goes
            pass
        self._map = None


class SlotPool:
    """The sender's side: which slots are free, and who waits for one."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self._free: deque[int] = deque(range(segment.slots))
        self._busy: set[int] = set()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    async def acquire(self) -> int:
        """A free slot (waits for a credit; the send's own timeout bounds the wait)."""
        while not self._free:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        slot = self._free.popleft()
        self._busy.add(slot)
        return slot

    def release(self, slot: object) -> None:
        """A credit from the receiver: ``slot`` may be reused."""
        if slot not in self._busy:
            raise ProtocolError(f"credit for shared-memory slot {slot!r}, which is not in use")
        assert isinstance(slot, int)
        self._busy.discard(slot)
        self._free.append(slot)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """The connection is gone: a send waiting for a slot raises ``exc``."""
        self._error = exc
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
