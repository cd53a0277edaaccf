"""Publish the gateway's AuditEvents to JetStream from one owned task, off the response path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from bus.errors import BusError
from gateway.metrics import Counter
from schemas.audit import AuditEvent

log = logging.getLogger("meshnet.gateway.audit")


class AuditBus(Protocol):
    """The part of bus.client.Bus used here."""

    async def publish_audit(self, event: AuditEvent) -> int: ...


class AuditPublisher:
    """A bounded queue of audit events and the loop that stores them (drops, counted, when full)."""

    def __init__(self, bus: AuditBus, *, max_queue: int = 1024, events: Counter | None = None):
        self.bus = bus
        self.queue: asyncio.Queue[AuditEvent] = asyncio.Queue(maxsize=max_queue)
        self.events = events or Counter("audit_events_total", "Audit events by outcome.", labelled=True)

    def offer(self, event: AuditEvent) -> bool:
        """Queue `event` without waiting; False (and counted as dropped) when the queue is full."""
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.events.inc(kind=event.kind, outcome="dropped")
            log.warning("audit queue full: dropped %s for session %s", event.kind, event.session_id)
            return False
        return True

    async def run(self) -> None:
        """Background loop: store queued events (publish_audit acks and retries) until cancelled."""
        while True:
            event = await self.queue.get()
            try:
                await self.bus.publish_audit(event)
                self.events.inc(kind=event.kind, outcome="published")
            except (BusError, ValueError) as exc:
                self.events.inc(kind=event.kind, outcome="failed")
                log.warning("audit %s for %s not stored: %s", event.kind, event.session_id, exc)
            finally:
                self.queue.task_done()

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every queued event to be handled; True if all were."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.queue.join(), timeout)
            return True
        return False
