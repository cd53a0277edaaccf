"""Outbox: a bounded, never-blocking queue of bus messages and the loop that publishes them.

Hot paths (frame handling, the decode loop) offer messages synchronously; one owned task
publishes them. When the queue is full the oldest message is dropped and counted, so a slow
or absent bus can never slow a session down or grow memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from schemas.base import BusMessage

log = logging.getLogger("meshnet.bus.outbox")

M = TypeVar("M", bound=BusMessage)


class Publisher(Protocol):
    """The part of bus.client.Bus an Outbox uses."""

    async def publish(self, subject: str, msg: BusMessage) -> None: ...


class Outbox(Generic[M]):
    """Queue messages with `offer` (sync); `run` publishes them until cancelled."""

    def __init__(
        self, bus: Publisher, subject_of: Callable[[M], str], *, max_queue: int, name: str
    ) -> None:
        self.bus = bus
        self.subject_of = subject_of
        self.name = name
        self.queue: asyncio.Queue[M] = asyncio.Queue(maxsize=max_queue)
        self.published = 0
        self.dropped = 0  # queue full: the oldest message was discarded
        self.failed = 0  # the bus refused or lost the publish

    def offer(self, msg: M) -> None:
        """Queue `msg` without blocking; when full, drop the oldest and count it."""
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("%s outbox full: %d message(s) dropped so far", self.name, self.dropped)
        self.queue.put_nowait(msg)

    async def run(self) -> None:
        """Background loop: publish queued messages until cancelled."""
        while True:
            msg = await self.queue.get()
            try:
                await self.bus.publish(self.subject_of(msg), msg)
                self.published += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost telemetry message never ends the loop
                self.failed += 1
                log.warning("%s message on %s not published: %s", self.name,
                            self.subject_of(msg), exc)
