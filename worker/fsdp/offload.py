"""Offload: FSDP's flat shards and optimizer state kept in memory-mapped files.

Each offloaded array lives in its own shared file mapping. The file is unlinked as soon
as it is mapped, so it has no name from then on: nothing is left in the directory after
any exit, a SIGKILL included. Its disk space is freed when the mapping goes: at
``FSDP.aclose`` for mappings nothing else uses, otherwise with the last array over it
(the wrapper's units, or an optimizer whose state is still referenced).

Paging is explicit and per unit. A unit's arrays are touched where they are used (its
gather reads the shard, a reduction adds into the gradient shard, the optimizer updates
all of them), and afterwards :meth:`UnitSpill.page_out` drops their pages from this
process (``madvise(MADV_DONTNEED)``). For a shared file mapping that loses nothing: the
bytes stay in the file's page cache, which the kernel writes to disk and evicts under
memory pressure, and the next touch maps them back. :meth:`UnitSpill.page_in` asks for
read-ahead (``MADV_WILLNEED``) before a use, so prefetch also covers the page-in.
Resident memory is then about one unit's arrays instead of all of them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwire.protocol.errors import InvalidArgument


@dataclass(frozen=True)
class Offload:
    """Which per-rank state FSDP keeps in memory-mapped files, and where.

    Attributes:
        params: the flat parameter shards (for NO_SHARD, the whole parameters).
        grads: the reduced gradient shards.
        optimizer: the optimizer's state arrays (momentum, Adam's moments).
        directory: where the files are made; put it on a disk with room for them
            (default: the system temporary directory).
    """

    params: bool = True
    grads: bool = True
    optimizer: bool = True
    directory: str | Path | None = None

    def __post_init__(self) -> None:
        if self.directory is not None and not Path(self.directory).is_dir():
            raise InvalidArgument(f"offload directory {self.directory} is not a directory")


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim  # glibc
        return trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``).

    numpy allocates arrays with ``malloc``; glibc keeps freed blocks below its dynamic
    mmap threshold (up to 32 MiB) in the heap, so the memory of the unsharded model, or
    of a step's gathered parameters and full gradients, stays resident after it is
    freed. Returns whether anything was released (False where there is no glibc)."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class Spill:
    """One array in an unnamed shared file mapping."""

    def __init__(self, directory: str | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        size = max(1, count * dtype.itemsize)
        fd, path = tempfile.mkstemp(prefix="shardwire-offload-", dir=directory)
        try:
            os.unlink(path)
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array: np.ndarray = np.frombuffer(self._map, dtype, count=count).reshape(shape)

    def page_out(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def page_in(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_WILLNEED)

    def close(self) -> None:
        """Unmap now, unless arrays over it are still referenced elsewhere (then the
        mapping goes with the last of them)."""
        if self._map is None:
            return
        del self.array
        try:
            self._map.close()
        except BufferError:
            pass
        self._map = None


class UnitSpill:
    """The spilled arrays of one unit, paged in and out together."""

    def __init__(self, directory: str | None) -> None:
        self._directory = directory
        self.spills: list[Spill] = []

    def array(self, like: np.ndarray, *, copy: bool) -> np.ndarray:
        """A file-backed array shaped like ``like``: its copy, or zeros."""
        spill = Spill(self._directory, like.shape, like.dtype)
        if copy:
            spill.array[...] = like
        self.spills.append(spill)
        return spill.array

    def page_out(self) -> None:
        for spill in self.spills:
            spill.page_out()

    def page_in(self) -> None:
        for spill in self.spills:
            spill.page_in()

    def close(self) -> None:
        for spill in self.spills:
            spill.close()
        self.spills.clear()


class OffloadStore:
    """Every unit's spill, by unit index (the order of ``FSDP.all_units()``)."""

    def __init__(self, offload: Offload) -> None:
        self.offload = offload
        directory = None if offload.directory is None else str(offload.directory)
        self._directory = directory
        self.units: list[UnitSpill] = []

    def unit(self) -> UnitSpill:
        spill = UnitSpill(self._directory)
        self.units.append(spill)
        return spill

    def slot(self, index: int, name: str, like: np.ndarray) -> np.ndarray:
        """Optimizer state array ``name`` of unit ``index`` (an Optimizer slot factory)."""
        del name
        return self.units[index].array(like, copy=False)

    def close(self) -> None:
        for spill in self.units:
            spill.close()
