"""AuditPublisher: the tracker's Route Participation events (one per hop of each route it
opens) go to the audit stream from a bounded queue, off the route request's path."""

from __future__ import annotations

import asyncio
import logging

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from schemas.audit import AuditEvent, RouteParticipation
from schemas.route import RouteSession

log = logging.getLogger("meshnet.tracker")


class AuditPublisher:
    """`queue(session)` on the request path; `run()` publishes (a task of the tracker's)."""

    def __init__(self, bus: Bus, tracker_id: str, maxsize: int) -> None:
        self.bus = bus
        self.tracker_id = tracker_id
        self._queue: asyncio.Queue[AuditEvent] = asyncio.Queue(maxsize=maxsize)
        self.published = 0
        self.dropped = 0

    def queue(self, session: RouteSession) -> None:
        for i in range(len(session.hops)):
            # the subject names the publisher's role, and the event's source must agree with it
            # (bus.subjects.bound_fields), whichever tracker of a group sends it
            event = RouteParticipation.for_hop(session, i, subjects.publisher("tracker"))
            try:
                self._queue.put_nowait(event)
            except asyncio.QueueFull:
                self.dropped += 1
                log.error("audit queue full: dropped route participation of %s", session.route_id)

    async def run(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self.bus.publish_audit(event)
                self.published += 1
            except (BusError, ValueError) as exc:  # never the end of the publisher: the next event goes on
                self.dropped += 1
                log.error("audit event %s lost: %s", event.event_id, exc)
            finally:
                self._queue.task_done()

    async def drained(self) -> None:
        """Wait until every queued audit event was acknowledged or given up."""
        await self._queue.join()
