"""Shared words between processes: loads, stores, a fence, and futex sleep and wake.

Memory ordering rule
--------------------
A rank publishes with *data stores, then a release store of its sequence word*, and a
reader does *an acquire load of the sequence word, then data loads*. On x86-64 (TSO)
plain aligned stores are seen by other cores in program order and loads are not
reordered with older loads, so plain ctypes loads and stores are enough there
(``PLAIN``). Everywhere else (aarch64 reorders both) the words go through libatomic's
``__atomic_load_8`` (acquire) and ``__atomic_store_8`` (release), which emit ``ldar`` and
``stlr``: the release store cannot pass the data stores before it, and no data load can
move above the acquire load.

Sleeping uses a 32-bit *bell* word per rank: a publisher changes its bell after every
publish, a sleeper reads the bell, checks its condition and sleeps with
``FUTEX_WAIT(bell, seen)``, which returns at once if the bell moved in between (the
kernel compares atomically), so no wake-up is lost. The futex is shared (no
``FUTEX_PRIVATE_FLAG``): the word lives in a mapping of several processes.

A wake is a system call (~2 us through ctypes here), so a publisher wakes only if
someone said it may sleep: the sleeper sets the publisher's *sleepers* flag with an
atomic exchange (a full fence) before its last look at the bell, and the publisher
changes the bell with an atomic exchange before it reads the flag. In the single total
order of the two exchanges, either the sleeper sees the new bell (and does not sleep) or
the publisher sees the flag (and wakes it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF
_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5

MACHINE = platform.machine().lower()
# x86-64's store and load order makes plain accesses enough (see the module docstring).
PLAIN = MACHINE in ("x86_64", "amd64")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libatomic() -> ctypes.CDLL:
    # The runtime's own soname first: the dynamic loader finds it without the helper
    # process (ldconfig, a compiler) find_library may start.
    try:
        return ctypes.CDLL("libatomic.so.1")
    except OSError:
        name = ctypes.util.find_library("atomic")
        if name is None:
            raise
        return ctypes.CDLL(name)


def missing() -> str:
    """Why words cannot be shared here ("" if they can): libatomic (the fences and
    atomic exchanges) must load."""
    try:
        _libatomic()
    except OSError as exc:
        return f"libatomic cannot be loaded ({exc}); install libatomic1"
    return ""


class Words:
    """Atomic access to the 32- and 64-bit words of ``size`` bytes at address ``base``."""

    def __init__(self, base: int, size: int, *, plain: bool = PLAIN) -> None:
        self.base = base
        self.plain = plain
        # Indexable views (a prebuilt ctypes array reads a word in ~0.1 us, a ctypes
        # object made per access in ~0.4 us).
        self.u64 = (ctypes.c_uint64 * (size // 8)).from_address(base)
        self.u32 = (ctypes.c_uint32 * (size // 4)).from_address(base)
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._futex = _SYS_FUTEX.get(MACHINE)
        lib = _libatomic()
        self._xchg4 = getattr(lib, "__atomic_exchange_4")
        self._xchg4.restype, self._xchg4.argtypes = (
            ctypes.c_uint32,
            [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int],
        )
        self._add4 = getattr(lib, "__atomic_fetch_add_4")
        self._add4.restype, self._add4.argtypes = (
            ctypes.c_uint32,
            [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int],
        )
        self._load4 = getattr(lib, "__atomic_load_4")
        self._load4.restype, self._load4.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int]
        self._load8 = getattr(lib, "__atomic_load_8")
        self._load8.restype, self._load8.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int]
        self._store8 = getattr(lib, "__atomic_store_8")
        self._store8.restype = None
        self._store8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        # The same exchange without argument conversion, for the publish path: it takes a
        # prebuilt pointer and a value below 2**31 (0.6 us a call here, against 1.1).
        self._swap = getattr(ctypes.CDLL(lib._name), "__atomic_exchange_4")

    def pointer(self, offset: int) -> ctypes.c_void_p:
        """A prebuilt pointer to the word at ``offset``, for :meth:`swap`."""
        return ctypes.c_void_p(self.base + offset)

    def swap(self, pointer: ctypes.c_void_p, value: int) -> None:
        """Sequentially consistent exchange (a full fence) of the u32 at ``pointer`` with
        ``value`` (at most 2**31 - 1)."""
        self._swap(pointer, value, _SEQ_CST)

    # ---- 64-bit sequence words --------------------------------------------------------

    def load(self, offset: int) -> int:
        """Acquire load of the u64 at ``offset``."""
        if self.plain:
            return self.u64[offset >> 3]
        return int(self._load8(self.base + offset, _ACQUIRE))

    def store(self, offset: int, value: int) -> None:
        """Release store of the u64 at ``offset``."""
        if self.plain:
            self.u64[offset >> 3] = value
        else:
            self._store8(self.base + offset, value, _RELEASE)

    # ---- 32-bit bells and flags ---------------------------------------------------------

    def load32(self, offset: int) -> int:
        """Sequentially consistent load of the u32 at ``offset`` (a plain load on x86-64)."""
        if self.plain:
            return self.u32[offset >> 2]
        return int(self._load4(self.base + offset, _SEQ_CST))

    def exchange32(self, offset: int, value: int) -> int:
        """Sequentially consistent exchange (a full fence); returns the old value."""
        return int(self._xchg4(self.base + offset, value & 0xFFFFFFFF, _SEQ_CST))

    def add32(self, offset: int, value: int) -> None:
        """Sequentially consistent add to the u32 at ``offset``."""
        self._add4(self.base + offset, value & 0xFFFFFFFF, _SEQ_CST)

    def sleep(self, offset: int, seen: int, timeout: float) -> None:
        """Sleep until the u32 at ``offset`` is woken, unless it no longer holds ``seen``
        (at most ``timeout`` seconds; spurious returns are allowed)."""
        if self._futex is None:  # no futex here: a short sleep keeps waits bounded
            os.sched_yield()
            return
        seconds = max(0.0, timeout)
        spec = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
        result = self._syscall(
            self._futex,
            ctypes.c_void_p(self.base + offset),
            _FUTEX_WAIT,
            ctypes.c_uint32(seen),
            ctypes.byref(spec),
            None,
            0,
        )
        if result == -1:
            err = ctypes.get_errno()
            if err not in (errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT):
                raise OSError(err, f"futex wait: {os.strerror(err)}")

    def wake(self, offset: int) -> None:
        """Wake every sleeper on the u32 at ``offset``."""
        if self._futex is not None:
            self._syscall(
                self._futex,
                ctypes.c_void_p(self.base + offset),
                _FUTEX_WAKE,
                _WAKE_ALL,
                None,
                None,
                0,
            )
