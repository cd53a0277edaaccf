"""A connection's round trip to its NATS server, measured: what a distant bus adds to every
request a part awaits on it (docs/control-plane.md, "A distant bus").

`BusRtt` keeps the last few round trips (a PING's PONG) and says what one costs now: the median
of them, so one slow sample (a reconnect, a busy loop) does not stretch every wait built on it.
`watch_rtt(bus, rtt)` measures one every `RTT_PROBE_S` for as long as its owner runs it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from bus.errors import BusError

RTT_PROBE_S = 1.0  # a round trip is measured this often
RTT_SAMPLES = 5  # the median of this many recent ones is the figure
RTT_PROBE_TIMEOUT_S = 5.0  # a round trip slower than this is no sample (the bus is away, not far)


class Flushable(Protocol):
    async def flush(self, timeout: float = ...) -> None: ...


@dataclass(slots=True)
class BusRtt:
    """Recent round trips to the server, in seconds; 0.0 until one is measured."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))

    def add(self, seconds: float) -> None:
        self.samples.append(max(0.0, seconds))

    def seconds(self) -> float:
        """The round trip a request to the server costs now: the median of the recent ones."""
        return statistics.median(self.samples) if self.samples else 0.0


async def measure_rtt(bus: Flushable, rtt: BusRtt, timeout: float = RTT_PROBE_TIMEOUT_S) -> float | None:
    """One round trip to the server, added to `rtt`; None when the bus gives no answer in time."""
    started = time.monotonic()
    try:
        await bus.flush(timeout=timeout)
    except (BusError, OSError, TimeoutError):
        return None
    took = time.monotonic() - started
    rtt.add(took)
    return took


async def watch_rtt(bus: Flushable, rtt: BusRtt, every: float = RTT_PROBE_S) -> None:
    """Measure the bus's round trip every `every` seconds (until cancelled)."""
    while True:
        await measure_rtt(bus, rtt)
        await asyncio.sleep(every)


__all__ = ["RTT_PROBE_S", "BusRtt", "measure_rtt", "watch_rtt"]
