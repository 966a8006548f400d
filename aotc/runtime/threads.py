"""Intra-op threads that yield the CPUs other processes are using.

Compiled CPU graphs run each kernel as an OpenMP parallel region over all of
torch's threads, and a region ends when its slowest thread does. Next to one
CPU-bound process on a 2-core machine, one of aotc's two threads shares a core
with it, and every region waits for that thread's next time slice: decode fell
to a third of its quiet speed, and lower with more busy processes
(`python bench/perf.py --sections contention`). One thread on the free core kept
86% of it.

So `generate` asks a `ThreadGovernor` before each step. Every tenth of a
second it reads how much CPU time the machine spent busy (/proc/stat) less what
this process spent (os.times(): all its threads, spinning ones included), which
is the number of CPUs that other processes keep busy, and sets torch's thread
count to the CPUs left (at least 1, at most the count it started with). The
first count, before any interval has passed, comes from the processes running
at that moment (/proc/loadavg) less this process's running threads, so that a
short generation next to a busy process does not start at full width. It costs
one read of /proc/stat per interval; where there is no /proc it does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import AotcError

INTERVAL_S = 0.1  # /proc/stat counts in 10 ms ticks: 10 per CPU per interval


def cpu_counters() -> tuple[float, float] | None:
    """(seconds the machine's CPUs spent busy, seconds this process ran), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: idle and iowait are idle time.
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def running_elsewhere() -> int | None:
    """Threads running right now in other processes: /proc/loadavg's running count
    less this process's threads in state R; None without /proc."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        ours = 0
        for task in Path("/proc/self/task").iterdir():
            try:
                ours += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # the thread ended meanwhile
                pass
    except (OSError, IndexError, ValueError):
        return None
    return max(0, running - ours)


class ThreadGovernor:
    """Keeps torch's intra-op threads to the CPUs that other processes leave free.

    `threads` fixes the count instead (the governor then only sets it once).
    `counters` and `clock` are injectable for tests."""

    def __init__(
        self, threads: int | None = None, *, counters: Callable[[], tuple[float, float] | None] = cpu_counters,
        elsewhere: Callable[[], int | None] = running_elsewhere, clock: Callable[[], float] = time.monotonic, interval: float = INTERVAL_S,
    ) -> None:  # fmt: skip
        cpus = os.cpu_count() or 1
        if threads is not None and not 1 <= threads <= cpus:
            # torch.set_num_threads(100000) crashes the process (a segfault in its pool).
            raise AotcError(f"--threads {threads}: expected 1 to {cpus}, the CPUs this machine has")
        self.started_with = torch.get_num_threads()
        self.limit = threads or self.started_with
        self.fixed = threads is not None
        self.counters, self.clock, self.interval = counters, clock, interval
        self.cpus = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the machine
        others = None if self.fixed else elsewhere()
        self.threads = self.limit if others is None else self._fit(others)
        torch.set_num_threads(self.threads)
        self.last = None if self.fixed else self._sample()

    def _fit(self, others: float) -> int:
        return max(1, min(self.limit, round(self.cpus - others)))

    def _sample(self):
        c = self.counters()
        return None if c is None else (self.clock(), *c)

    def step(self) -> int:
        """Called before each step; returns the thread count in use."""
        if self.last is None or self.clock() - self.last[0] < self.interval:
            return self.threads
        now = self._sample()
        wall, busy, own = (a - b for a, b in zip(now, self.last))
        self.last = now
        others = max(0.0, (busy - own) / wall) if wall > 0 else 0.0
        threads = self._fit(others)
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)
        return self.threads

    def restore(self) -> None:
        torch.set_num_threads(self.started_with)
