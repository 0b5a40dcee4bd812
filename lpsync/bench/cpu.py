"""CPU seconds of whole processes, for ``lpsync bench --cluster``'s CPU per GB.

A process's CPU clock (Linux: the CPUCLOCK_SCHED clock of a pid, what
``clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`` reads for the caller) counts the user and
system time of every thread the process has had, exited ones included, in nanoseconds;
/proc/<pid>/stat's utime+stime count the same in clock ticks (10 ms), too coarse for one
collective. Time the kernel spends for a process in softirq context (the receive side of
its sockets) is charged to whichever process was running, so part of it is not counted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from lpsync.errors import LpsyncError

_CPUCLOCK_SCHED = 2  # include/linux/posix-timers.h: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def process_clock(pid: int) -> int:
    """The clock id of ``pid``'s CPU clock (clock_getcpuclockid(3), which Python lacks)."""
    return ((~pid) << 3) | _CPUCLOCK_SCHED


def cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` has used so far, every thread; the calling process must be
    allowed to read it (same user, or root)."""
    if pid == os.getpid():
        return time.process_time()
    try:
        return time.clock_gettime(process_clock(pid))
    except OSError as error:
        raise LpsyncError(
            f"cannot read the CPU time of process {pid} (gone, or not ours?): {error}"
        ) from None


@dataclass(frozen=True)
class CpuMeter:
    """Reads this process's CPU seconds and, when ``daemon_pid`` is set, its daemon's."""

    daemon_pid: int | None = None  # this node's daemon; None: only this process

    def read(self) -> tuple[float, float]:
        own = time.process_time()
        return own, (cpu_seconds(self.daemon_pid) if self.daemon_pid is not None else 0.0)
