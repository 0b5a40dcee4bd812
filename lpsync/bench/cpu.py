"""CPU seconds and context switches of whole processes, for ``lpsync bench --cluster``'s
CPU per GB and its CPU and switches per call.

A process's CPU clock (Linux: the CPUCLOCK_SCHED clock of a pid, what
``clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`` reads for the caller) counts the user and
system time of every thread the process has had, exited ones included, in nanoseconds;
/proc/<pid>/stat's utime+stime count the same in clock ticks (10 ms), too coarse for one
collective. Time the kernel spends for a process in softirq context (the receive side of
its sockets) is charged to whichever process was running, so part of it is not counted:
an engine that keeps the CPUs busy absorbs more of it than one that leaves them idle.
The whole machine's busy time (/proc/stat: every CPU's time outside idle, iowait and
steal; softirq included wherever it ran) counts all of it, and everything else the
machine did: read it beside the processes' figure, on a machine that runs nothing else.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

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


_SWITCH_FIELDS = ("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")


def context_switches(pid: int) -> int:
    """How often ``pid``'s threads have been switched out so far, voluntarily (a sleep: a
    wait for a socket, a lock, a condition) or not: each is a wake-up later, which costs
    ~15 us of CPU on these VMs (docs/benchmarks.md at 623decd, 2026-12-05). Every thread of this
    process, exited ones included (getrusage); of another, its live threads
    (/proc/<pid>/task), so a thread that ends during a measurement takes its count with it."""
    if pid == os.getpid():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_nvcsw + usage.ru_nivcsw
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError as error:
        raise LpsyncError(f"cannot read the threads of process {pid} (gone?): {error}") from None
    total = 0
    for task in tasks:
        try:
            status = Path(f"/proc/{pid}/task/{task}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith(_SWITCH_FIELDS):
                total += int(line.split()[1])
    return total


_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# proc(5), the "cpu" line of /proc/stat: user nice system idle iowait irq softirq steal
# (guest is already in user). Idle, iowait and steal (the hypervisor running others) are
# not this machine's work.
_BUSY_FIELDS = (0, 1, 2, 5, 6)


def machine_busy_seconds(stat: str = "/proc/stat") -> float:
    """CPU seconds the machine's CPUs have spent busy since boot, all CPUs together (user,
    nice, system, irq, softirq; not idle, iowait or steal). The counts are clock ticks of
    10 ms, and a loop of seconds needs no finer clock."""
    with open(stat) as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in _BUSY_FIELDS) / _TICKS_PER_SECOND


@dataclass(frozen=True)
class CpuMeter:
    """Reads this process's CPU seconds, its daemon's when ``daemon_pid`` is set, and the
    whole machine's busy seconds when ``machine`` is set (one rank of a run reads it: the
    emulated nodes share the machine); and the context switches of this process and its
    daemon."""

    daemon_pid: int | None = None  # this node's daemon; None: only this process
    machine: bool = False

    def read(self) -> tuple[float, float, float, int, int]:
        """(own CPU s, daemon CPU s, machine busy s, own switches, daemon switches); 0
        for what is not read."""
        own, switches = time.process_time(), context_switches(os.getpid())
        daemon = cpu_seconds(self.daemon_pid) if self.daemon_pid is not None else 0.0
        daemon_switches = context_switches(self.daemon_pid) if self.daemon_pid is not None else 0
        return own, daemon, (machine_busy_seconds() if self.machine else 0.0), switches, daemon_switches
