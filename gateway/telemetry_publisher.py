"""Publish Generation Telemetry on mesh.session.<id>.telemetry, throttled, off the token path."""

from __future__ import annotations

import time
from collections.abc import Callable

from bus import subjects
from bus.outbox import Outbox, Publisher
from gateway.telemetry import TERMINAL
from schemas.telemetry import GenerationTelemetry

THROTTLED_PHASES = frozenset({"queued", "decode"})  # phases whose progress events are many


def bus_should_publish(
    *, phase_changed: bool, phase: str, now: float, last: float | None, interval: float
) -> bool:
    """Every phase change goes out; queue moves and decode progress at most once per
    `interval` seconds (a departure moves every waiter: one event each, locally)."""
    if phase_changed or phase not in THROTTLED_PHASES or last is None:
        return True
    return now - last >= interval


class TelemetryPublisher:
    """The hub's bus sink: throttles Generation Telemetry onto a bounded Outbox."""

    def __init__(
        self,
        bus: Publisher,
        *,
        interval: float = 0.25,
        max_queue: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.outbox: Outbox[GenerationTelemetry] = Outbox(
            bus, lambda e: subjects.session_telemetry(e.session_id), max_queue=max_queue,
            name="session telemetry")
        self.run = self.outbox.run
        self._last: dict[str, float] = {}
        self._clock = clock

    def offer(self, event: GenerationTelemetry, phase_changed: bool) -> None:
        """Hub sink: queue the event if the throttle lets it through (drops oldest when full)."""
        now = self._clock()
        if not bus_should_publish(
            phase_changed=phase_changed, phase=event.phase, now=now,
            last=self._last.get(event.session_id), interval=self.interval,
        ):
            return
        if event.phase in TERMINAL:
            self._last.pop(event.session_id, None)
        else:
            self._last[event.session_id] = now
        self.outbox.offer(event)
