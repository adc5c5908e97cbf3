"""Reading another local rank's memory straight into this rank's array
(``process_vm_readv``, Linux's cross-memory attach).

The arena's all_gather of large parts uses it (``programs.all_gather``): each rank
publishes where its input lies, and every other rank copies it from there into its own
output in one pass, where going through the shared region costs two (into a half, out
of it). The kernel allows it between processes of one user unless a policy forbids it
(Yama's ``ptrace_scope`` 1 or more, a seccomp profile that refuses the call, a process
made non-dumpable): shardwire never loosens such a policy. Whether the ranks of a group
may read each other is tried when its arena opens (``probe``), and the group uses the
shared region alone where they may not.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _bind() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return call


_READV = _bind()


class ReadFailed(Exception):
    """Reading local rank ``rank``'s memory failed with ``code`` (an errno)."""

    def __init__(self, rank: int, code: int) -> None:
        super().__init__(f"reading local rank {rank}'s memory failed: {os.strerror(code)}")
        self.rank = rank
        self.code = code


def read(pid: int, dst: np.ndarray, address: int, *, rank: int) -> None:
    """Fill ``dst`` (C-contiguous) with the bytes at ``address`` in process ``pid``
    (local rank ``rank``, named by :class:`ReadFailed`)."""
    if _READV is None:
        raise ReadFailed(rank, errno.ENOSYS)
    here, total, done = dst.ctypes.data, dst.nbytes, 0
    local, remote = _Iovec(), _Iovec()
    while done < total:  # the kernel may stop short (a page it could not take)
        local.base, local.length = here + done, total - done
        remote.base, remote.length = address + done, total - done
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            raise ReadFailed(rank, ctypes.get_errno())
        if got == 0:
            raise ReadFailed(rank, errno.EFAULT)
        done += got


class Bait:
    """Sixteen random bytes another rank reads to find out whether it may
    (:func:`probe`); kept alive by whoever offers them."""

    def __init__(self) -> None:
        self.data = np.frombuffer(bytearray(os.urandom(16)), np.uint8)

    def offer(self) -> dict:
        return {"pid": os.getpid(), "at": self.data.ctypes.data, "tag": self.data.tobytes().hex()}


def probe(offer: dict, rank: int) -> str:
    """ "" if this process can read local rank ``rank``'s :class:`Bait` (``offer``), else
    why not."""
    try:
        pid, at, tag = int(offer["pid"]), int(offer["at"]), bytes.fromhex(str(offer["tag"]))
    except (KeyError, TypeError, ValueError):
        return f"local rank {rank} offered nothing to read"
    got = np.zeros(len(tag), np.uint8)
    try:
        read(pid, got, at, rank=rank)
    except ReadFailed as exc:
        return str(exc)
    return "" if got.tobytes() == tag else f"local rank {rank}'s memory read back wrong"
