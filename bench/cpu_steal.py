"""CPU time the hypervisor gave to other guests while this VM wanted it (steal, from /proc/stat).

Benchmarks report it beside their figures: on a shared host it slows llama.cpp more than its
share, since a thread that is not running holds the other at the graph's next barrier (a
failover soak here saw 10-40 % steal in the 3 s after a kill, and half the cores' time lost
to steal plus the idle time of threads waiting at barriers). `CpuSampler` samples the counters
while a benchmark runs; `steal_pct` gives the share of one window.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL = 7  # the 8th field of the "cpu" line: steal


def cpu_times() -> list[int] | None:
    """The machine's cumulative CPU times (user, nice, system, idle, iowait, irq, softirq,
    steal, ...) in clock ticks, or None where /proc/stat is missing."""
    try:
        line = PROC_STAT.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = line.split()
    return [int(x) for x in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Steal as a percentage of all CPU time between two readings (None without both)."""
    if before is None or after is None or len(before) <= STEAL:
        return None
    total = sum(after[:8]) - sum(before[:8])  # guest times are already counted in user
    return round(100.0 * (after[STEAL] - before[STEAL]) / total, 1) if total > 0 else None


class CpuSampler:
    """Reads the counters every `every_s` while `run` is awaited (a task the benchmark owns)."""

    def __init__(self, every_s: float = 0.25) -> None:
        self.every_s = every_s
        self.at: list[float] = []  # time.monotonic() of each reading
        self.times: list[list[int]] = []

    def sample(self) -> None:
        times = cpu_times()
        if times is not None:
            self.at.append(time.monotonic())
            self.times.append(times)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.every_s)
            except TimeoutError:
                pass
        self.sample()

    def steal_pct(self, start: float | None = None, end: float | None = None) -> float | None:
        """Steal share between the readings nearest after `start` and before `end` (monotonic
        times; the whole run by default)."""
        if not self.at:
            return None
        i = 0 if start is None else min(bisect.bisect_left(self.at, start), len(self.at) - 1)
        j = len(self.at) - 1 if end is None else max(bisect.bisect_right(self.at, end) - 1, 0)
        return steal_share(self.times[i], self.times[j]) if j > i else None
