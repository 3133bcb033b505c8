"""How many threads the kernels use, following the cores that other processes leave free.

A two-thread parallel region waits for its slowest thread: when another process takes a core, each
region waits a scheduler time slice for the descheduled thread, and a decode step of hundreds of
regions slows several-fold, far below what one thread alone would do. So the default ("auto") is the
number of cores idle when the process starts, at most the physical cores, re-measured every few
seconds between forward steps; a fixed count (--threads N) is kept as given.

Idle cores: over a short window, the machine's busy CPU time (/proc/stat) minus this process's own
(/proc/self/stat), in cores. Where /proc is missing (macOS), every allowed core counts as idle.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import kernels
from .options import thread_count

RESAMPLE_SECONDS = 2.0   # how often auto mode looks again: a few /proc reads, far below a step's cost
SAMPLE_SECONDS = 0.05    # the first look, at start


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


class CpuSampler:
    """Cores used by other processes since the previous sample."""

    def __init__(self):
        self.ticks_per_second = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.previous = self._read()

    @staticmethod
    def _read() -> tuple[float, int, int] | None:
        """(time, machine busy ticks, this process's ticks), or None without /proc."""
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
        busy = sum(fields[:8]) - idle                               # guest time is inside user time
        return time.monotonic(), busy, int(own[11]) + int(own[12])  # utime + stime

    def others_busy_cores(self) -> float | None:
        now = self._read()
        if now is None or self.previous is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self.previous, now
        self.previous = now
        if t1 - t0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / self.ticks_per_second / (t1 - t0)


def free_cores(others_busy: float | None, limit: int) -> int:
    """Cores left by other processes busy on `others_busy` cores, 1 .. limit. A core counts as free
    when at most a quarter of it is taken."""
    if others_busy is None:
        return limit
    return max(1, min(limit, int((os.cpu_count() or 1) - others_busy + 0.25)))


def idle_cores() -> int:
    """The cores other processes leave free now, at most the physical cores (a short look)."""
    sampler = CpuSampler()
    time.sleep(SAMPLE_SECONDS)
    return free_cores(sampler.others_busy_cores(), physical_cores())


def set_command_threads(threads: int | None) -> int:
    """For a command without forward steps (convert): `threads`, or the cores free now, applied to
    the kernels (numba and torch) once; returns the count, e.g. for a worker pool of that size (so
    that no pool runs two-thread parallel regions next to a busy process)."""
    n = thread_count(threads, "threads=") or idle_cores()
    kernels.set_threads(n)
    return n


class ThreadGovernor:
    """Sets the kernels' thread count: fixed, or (threads=None) the cores other processes leave free."""

    def __init__(self, threads: int | None = None):
        self.limit = physical_cores()
        self.fixed = thread_count(threads, "threads=")
        self.sampler = None if self.fixed else CpuSampler()
        self.current = 0
        self.next_look = 0.0
        if self.fixed:
            self._apply(self.fixed)

    def step(self) -> None:
        """Before a forward step: in auto mode, look at the machine (the first time, over the time since
        the governor was made, at least SAMPLE_SECONDS), then again every RESAMPLE_SECONDS."""
        if self.fixed or time.monotonic() < self.next_look:
            return
        if self.current == 0 and self.sampler.previous is not None:
            time.sleep(max(0.0, self.sampler.previous[0] + SAMPLE_SECONDS - time.monotonic()))
        self.next_look = time.monotonic() + RESAMPLE_SECONDS
        self._apply(free_cores(self.sampler.others_busy_cores(), self.limit))

    def _apply(self, n: int) -> None:
        if n != self.current:
            kernels.set_threads(n)
            self.current = n
