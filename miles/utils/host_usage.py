"""Where a host-bound step's wall time went: this thread's CPU time, its preemptions, and who else ran.

A train step dispatches tens of thousands of kernels from one Python thread; when its wall time is far above the
device's kernel time, the thread was either busy (Python and dispatch: its CPU time ≈ the wall) or not running
(waiting for the GIL held by another thread of the process, or descheduled by the OS in favour of other
processes: its CPU time well below the wall, with many involuntary context switches). `HostUsage.measure()`
snapshots the counters; `delta()` gives the step's share. Linux `/proc` gives per-thread and per-process CPU
times for the profile report (`process_table`); elsewhere those tables are empty.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class HostUsage:
    wall_s: float
    thread_cpu_s: float
    involuntary_switches: int
    threads: dict[int, tuple[str, float]] = field(default_factory=dict)  # tid -> (name, CPU s), this process
    processes: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (name, CPU s), the machine

    @staticmethod
    def measure(with_tables: bool = False) -> HostUsage:
        usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        return HostUsage(
            wall_s=time.perf_counter(),
            thread_cpu_s=time.thread_time(),
            involuntary_switches=int(usage.ru_nivcsw),
            threads=_cpu_times("/proc/self/task") if with_tables else {},
            processes=_cpu_times("/proc") if with_tables else {},
        )

    def delta(self, earlier: HostUsage) -> HostUsage:
        return HostUsage(
            wall_s=self.wall_s - earlier.wall_s,
            thread_cpu_s=self.thread_cpu_s - earlier.thread_cpu_s,
            involuntary_switches=self.involuntary_switches - earlier.involuntary_switches,
            threads=_table_delta(self.threads, earlier.threads),
            processes=_table_delta(self.processes, earlier.processes),
        )

    def metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>host_cpu_s` (the calling thread's CPU time) and `<prefix>host_preemptions`."""
        return {f"{prefix}host_cpu_s": self.thread_cpu_s, f"{prefix}host_preemptions": float(self.involuntary_switches)}

    def report(self, limit: int = 12) -> list[str]:
        """Lines for a profile report: the step's thread CPU time against its wall, then the busiest threads of
        this process and processes of the machine over the step."""
        lines = [f"host: this thread {self.thread_cpu_s:.3f} s CPU in {self.wall_s:.3f} s wall, "
                 f"{self.involuntary_switches} involuntary context switches"]
        for title, table in (("threads of this process", self.threads), ("processes of this machine", self.processes)):
            busiest = sorted(table.items(), key=lambda item: -item[1][1])[:limit]
            if busiest:
                lines.append(f"busiest {title} (CPU s over the step): "
                             + ", ".join(f"{name}[{ident}] {seconds:.2f}" for ident, (name, seconds) in busiest))
        return lines


def _cpu_times(directory: str) -> dict[int, tuple[str, float]]:
    """{id: (name, user + system CPU seconds)} of every numeric entry of a /proc-style directory."""
    times = {}
    try:
        entries = os.listdir(directory)
    except OSError:
        return times
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(directory, entry, "stat")) as handle:
                raw = handle.read()
        except OSError:  # gone between the listing and the read
            continue
        name = raw[raw.find("(") + 1 : raw.rfind(")")]
        fields = raw[raw.rfind(")") + 2 :].split()
        times[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS)  # utime, stime
    return times


def _table_delta(now: dict[int, tuple[str, float]], before: dict[int, tuple[str, float]]):
    return {ident: (name, seconds - before.get(ident, (name, 0.0))[1]) for ident, (name, seconds) in now.items()}
