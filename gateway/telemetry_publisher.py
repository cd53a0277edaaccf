"""Publish Generation Telemetry on mesh.session.<id>.telemetry, throttled, off the token path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from bus import subjects
from bus.errors import BusError
from gateway.telemetry import TERMINAL
from schemas.base import BusMessage
from schemas.telemetry import GenerationTelemetry

log = logging.getLogger("meshnet.gateway.telemetry")


class Publisher(Protocol):
    """The part of bus.client.Bus used here."""

    async def publish(self, subject: str, msg: BusMessage) -> None: ...


def bus_should_publish(
    *, phase_changed: bool, phase: str, now: float, last: float | None, interval: float
) -> bool:
    """Every phase change goes out; decode progress at most once per `interval` seconds."""
    if phase_changed or phase != "decode" or last is None:
        return True
    return now - last >= interval


class TelemetryPublisher:
    """A bounded queue between the hub (sync sink) and the bus (async publish task)."""

    def __init__(
        self,
        bus: Publisher,
        *,
        interval: float = 0.25,
        max_queue: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.interval = interval
        self.queue: asyncio.Queue[GenerationTelemetry] = asyncio.Queue(maxsize=max_queue)
        self.dropped = 0
        self.published = 0
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
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
        self.queue.put_nowait(event)

    async def run(self) -> None:
        """Background loop: publish queued events until cancelled."""
        while True:
            event = await self.queue.get()
            try:
                await self.bus.publish(subjects.session_telemetry(event.session_id), event)
                self.published += 1
            except (BusError, ValueError) as exc:
                log.warning("telemetry publish for %s failed: %s", event.session_id, exc)
