"""The admission gate: requests wait in the AdmissionQueue until a Route Session has room.

    async with gate.admitted(try_route, on_wait=..., client_gone=...) as session:
        ...  # drive the session; leaving the block frees its place under max_sessions

The first requests in line, as many as the gateway may still start sessions, call
`try_route(waited)` together: it returns a session, None for "no room yet" (the tracker said
no_capacity), or raises for any other refusal. Once the tracker said no_capacity, only the
head asks until the line is empty again, so requests waiting for the mesh's room keep their order. A waiter tries again at once when a session of
this gateway ends or another waiter leaves, and otherwise every `tick` seconds (capacity
other gateways freed). Each waiter is its own request handler's
task, so the gate owns no task; the waits are bounded by the queue timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from gateway.admission import AdmissionQueue, QueueLimits
from gateway.errors import ClientGoneError, QueueFullError, QueueRefusedError, QueueTimeoutError
from gateway.metrics import GatewayMetrics

T = TypeVar("T")
DEFAULT_QUEUE_TICK = 0.2  # seconds between a waiting head's retries when nothing here changed


class AdmissionGate:
    """Owns the gateway's count of driven sessions (≤ max_sessions) and its admission queue."""

    def __init__(
        self, limits: QueueLimits, *, max_sessions: int, metrics: GatewayMetrics,
        tick: float = DEFAULT_QUEUE_TICK, clock: Callable[[], float] = time.monotonic, owners: int = 1,
    ) -> None:
        self.queue = AdmissionQueue(limits)
        self.owners = owners  # API keys that share the queue (AdmissionQueue.join's fair share)
        self.max_sessions = max_sessions
        self.metrics = metrics
        self.tick = tick
        self.clock = clock
        self.active = 0
        self._running: dict[object, float] = {}  # each admitted session's start (the clock's)
        self.closed = False
        self.mesh_full = False  # an ask was answered no_capacity since the line was last empty: only the head asks
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """Wake every waiter: a session ended or the queue moved."""
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """Shutdown: every waiter leaves the queue with a 503 (shutting_down, Retry-After)."""
        self.closed = True
        self.notify()

    def room(self) -> int:
        """How many requests in line may ask for a route now."""
        free = max(0, self.max_sessions - self.active)
        return min(free, 1) if self.mesh_full else free

    def places(self) -> int:
        """The places whose ends let the line move: --max-sessions, or, while the mesh is full
        (the tracker said no_capacity), the sessions this gateway holds (at least 1): the mesh's
        room, less what other gateways hold of it."""
        return max(1, self.active) if self.mesh_full else self.max_sessions

    def _retry_after(self) -> int:
        """The Retry-After of a refusal now: the queue's estimate over the places that free up,
        with the running sessions' mean age as a floor for their length."""
        now = self.clock()
        ages = [now - started for started in self._running.values()]
        return self.queue.retry_after(self.places(), sum(ages) / len(ages) if ages else 0.0)

    def _publish(self) -> None:
        self.metrics.active.value = self.active
        self.metrics.queue_depth.value = self.queue.depth

    async def retry(self, try_route: Callable[[], Awaitable[T | None]], timeout: float) -> T | None:
        """For a session that keeps its place (a restart): `try_route()` again until it gives a
        route, at once when a session of this gateway ends and otherwise every `tick` seconds;
        None once `timeout` passed."""
        deadline = self.clock() + timeout
        while True:
            changed = self._changed  # taken before any await: no wake-up is missed
            got = await try_route()
            left = deadline - self.clock()
            if got is not None or left <= 0:
                return got
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(self.tick, left))

    @contextlib.asynccontextmanager
    async def admitted(
        self, try_route: Callable[[bool], Awaitable[T | None]], *,
        on_wait: Callable[[int], None], client_gone: Callable[[], bool], bounded: bool = True,
        owner: str | None = None,
    ) -> AsyncIterator[T]:
        """Wait for a place and a route; hold the place for the block. Raises QueueFullError,
        QueueTimeoutError, ClientGoneError, or whatever `try_route` raises. `bounded=False`:
        never refused for a full queue (AdmissionQueue.join). `owner`: whose key the request
        came with, for the queue's fair share and order."""
        result = await self._wait(try_route, on_wait, client_gone, bounded, owner)
        started = self.clock()
        place = object()
        self._running[place] = started
        try:
            yield result
        finally:
            del self._running[place]
            self.active -= 1
            self.queue.session_ended(self.clock() - started)
            self._publish()
            self.notify()

    async def _wait(
        self, try_route: Callable[[bool], Awaitable[T | None]],
        on_wait: Callable[[int], None], client_gone: Callable[[], bool], bounded: bool, owner: str | None,
    ) -> T:
        queue = self.queue
        room = self.room()
        ticket = queue.join(self.clock(), room=room, bounded=bounded, owner=owner, owners=self.owners)
        if ticket is None:
            raise QueueFullError(queue.limits.max_queue, retry_after=self._retry_after(),
                                 key_share=queue.share_held(owner, room, self.owners))
        self._publish()
        waited = False
        shown = 0  # the position on_wait last reported
        try:
            while True:
                changed = self._changed  # taken before any await: no wake-up is missed
                if client_gone():
                    raise ClientGoneError("client disconnected while queued")
                if self.closed:
                    raise QueueRefusedError("the gateway is shutting down; retry later",
                                            code="shutting_down", retry_after=self._retry_after())
                if queue.may_try(ticket, room=self.room()):
                    got = await try_route(waited)
                    self.mesh_full = self.mesh_full or got is None
                    if got is not None:
                        self.active += 1
                        return got
                remaining = queue.remaining(ticket, self.clock())
                if remaining <= 0:
                    raise QueueTimeoutError(queue.limits.timeout, retry_after=self._retry_after())
                position = queue.position(ticket)
                if position != shown:
                    on_wait(position)
                    shown = position
                waited = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(self.tick, remaining))
        finally:
            self.metrics.queue_wait.observe(queue.leave(ticket, self.clock()))
            if not queue.depth:
                self.mesh_full = False
            self._publish()
            self.notify()
