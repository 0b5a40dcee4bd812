"""Linux futexes on shared memory, through ctypes: the emulated device's interprocess
events block on them (a waiter sleeps in the kernel until the word changes; no polling).

The daemon's emulated device uses this module too (lpsync.memory.emulated): one copy.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_WAIT, _WAKE = 0, 1  # FUTEX_WAIT, FUTEX_WAKE (shared: the word lives in a MAP_SHARED mapping)
_SYSCALL = {"x86_64": 202, "aarch64": 98}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _number() -> int:
    machine = platform.machine()
    if machine not in _SYSCALL:
        raise OSError(f"futexes: unsupported machine {machine}")
    return _SYSCALL[machine]


def wait(address: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected``, at most ``timeout``
    seconds (returns early on a wake, a changed word or a signal: callers re-check)."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    result = _libc().syscall(
        _number(), ctypes.c_void_p(address), _WAIT, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0
    )
    if result == -1:
        errno = ctypes.get_errno()
        if errno not in (11, 110, 4):  # EAGAIN (word changed), ETIMEDOUT, EINTR
            raise OSError(errno, os.strerror(errno))


def wake(address: int) -> None:
    """Wake every waiter on the word at ``address``."""
    _libc().syscall(_number(), ctypes.c_void_p(address), _WAKE, 0x7FFFFFFF, None, None, 0)
