"""Admission queue decisions (pure): a bounded FIFO of requests waiting for a Route Session.

A request that finds no room (the gateway's own session cap is reached, or the tracker says
`no_capacity`) takes a ticket and waits. Only the head of the queue asks for a route, so a
later arrival never overtakes an earlier one. A wait ends when the request is admitted, its
client leaves, or `timeout` seconds pass; a request arriving at a full queue is refused at
once. Time is passed in; the asyncio side is gateway/admission_gate.py.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

DEFAULT_MAX_QUEUE = 256
DEFAULT_QUEUE_TIMEOUT = 60.0
WAIT_SMOOTHING = 0.2  # weight of the newest admitted wait in the recent-wait average


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How many requests may wait, and for how long each (seconds)."""

    max_queue: int = DEFAULT_MAX_QUEUE
    timeout: float = DEFAULT_QUEUE_TIMEOUT


def retry_after_seconds(recent_wait: float, timeout: float) -> int:
    """The `Retry-After` a refused request gets (pure): the recent admitted wait rounded up,
    at least 1 s and at most the queue timeout (rounded up)."""
    upper = max(1, math.ceil(timeout))
    return min(max(1, math.ceil(recent_wait)), upper)


@dataclass(slots=True)
class AdmissionQueue:
    """Tickets in arrival order with their arrival times; positions are 1-based."""

    limits: QueueLimits = field(default_factory=QueueLimits)
    recent_wait: float = 1.0  # smoothed wait of admitted requests (seconds): the Retry-After hint
    _tickets: list[int] = field(default_factory=list)  # ascending = arrival order
    _arrived: dict[int, float] = field(default_factory=dict)
    _next: int = 0

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._tickets)

    def join(self, now: float) -> int | None:
        """A ticket at the back of the queue, or None when the queue is full."""
        if len(self._tickets) >= self.limits.max_queue:
            return None
        self._next += 1
        self._tickets.append(self._next)
        self._arrived[self._next] = now
        return self._next

    def position(self, ticket: int) -> int:
        """1-based place of a waiting ticket (1 = the head); KeyError when it is not waiting."""
        if ticket not in self._arrived:
            raise KeyError(ticket)
        return bisect.bisect_left(self._tickets, ticket) + 1

    def may_try(self, ticket: int, *, has_room: bool) -> bool:
        """Whether this ticket asks for a route now: only the head, and only with room here."""
        return has_room and bool(self._tickets) and self._tickets[0] == ticket

    def remaining(self, ticket: int, now: float) -> float:
        """Seconds this ticket may still wait (≤ 0: its wait expired)."""
        return self._arrived[ticket] + self.limits.timeout - now

    def leave(self, ticket: int, now: float, *, admitted: bool) -> float:
        """Remove a ticket (admitted, expired or gone); returns how long it waited. An admitted
        wait updates `recent_wait`. Leaving twice is a no-op that returns 0."""
        arrived = self._arrived.pop(ticket, None)
        if arrived is None:
            return 0.0
        del self._tickets[bisect.bisect_left(self._tickets, ticket)]
        waited = max(0.0, now - arrived)
        if admitted:
            self.recent_wait += WAIT_SMOOTHING * (waited - self.recent_wait)
        return waited

    def retry_after(self) -> int:
        """Seconds a refused request is told to wait before trying again."""
        return retry_after_seconds(self.recent_wait, self.limits.timeout)
