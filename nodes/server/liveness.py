"""HeartbeatThread: a node's heartbeats leave on time even while a model call holds its loop.

With the inline engine placement every model call runs on the event loop's thread, and a
heartbeat needs several turns of the loop to reach the socket (the sleep's timer, the task
that publishes, the client's flusher). Each turn may carry one iteration of the hop
scheduler, so during a long prompt's prefill slices a 1 s heartbeat went out 2.5 s late on a
loaded 2-core machine, close to the tracker's 3 s expiry (and past it under CI load: the
tracker aborted every session of a node that was working for them).

So heartbeats go out from a thread of their own, over a connection of their own (ctypes
releases the GIL during llama.cpp calls, so the thread runs while the loop computes). The
loop still builds each heartbeat (`offer`, once per interval) because only the loop may read
its session table; the thread publishes the latest offer, restamped, every interval. A loop
that has not offered for `stall_s` is stuck rather than busy: the thread then goes quiet, so
the tracker expires the node as it should.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from bus.client import Bus
from schemas.node import NodeHeartbeat

log = logging.getLogger("meshnet.node.liveness")

DEFAULT_STALL_S = 10.0  # no iteration runs this long (the hop scheduler bounds prefill slices to ~0.5 s)


def beat_is_fresh(offered_at: float | None, now: float, stall_s: float) -> bool:
    """Whether the loop's latest heartbeat is recent enough to vouch for it (pure)."""
    return offered_at is not None and now - offered_at <= stall_s


def next_tick(last_at: float, now: float, interval_s: float) -> float:
    """When the next heartbeat is due after the one due at `last_at` (pure). Ticks missed while
    the process was frozen (SIGSTOP, a VM pause) are skipped, not made up: catching up sent a
    burst of one heartbeat per missed interval at once (or, with a stale offer, logged the
    loop's stall once per ten of them, all in the same millisecond)."""
    return max(last_at + interval_s, now)


class HeartbeatThread:
    """Publishes the latest offered NodeHeartbeat on `subject` every `interval_s` from a thread."""

    def __init__(self, bus: Bus, subject: str, *, interval_s: float, stall_s: float = DEFAULT_STALL_S) -> None:
        self.bus = bus  # the loop's connection: the thread connects a twin of it
        self.subject = subject
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.published = 0
        self.withheld = 0  # intervals skipped because the loop had stopped offering
        self._streak = 0
        self._beat: NodeHeartbeat | None = None
        self._offered_at: float | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def offer(self, beat: NodeHeartbeat) -> None:
        """Called on the node's loop: the heartbeat the thread sends from now on."""
        self._beat, self._offered_at = beat, time.monotonic()

    def start(self) -> None:
        """Connect the thread's own bus and start publishing; raises if it cannot connect."""
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()
        self._started.wait(30.0)
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop publishing and close the thread's connection."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(), or logged once the thread ran
            if not self._started.is_set():
                self._error = exc
                self._started.set()
            else:
                log.exception("heartbeat thread ended")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        bus = await self.bus.twin(name=f"{self.bus.name or 'node'}-heartbeat")
        self._started.set()
        try:
            next_at = time.monotonic()
            while not self._stop.is_set():
                next_at = next_tick(next_at, time.monotonic(), self.interval_s)
                try:
                    await asyncio.wait_for(self._stop.wait(), max(0.0, next_at - time.monotonic()))
                    break
                except TimeoutError:
                    pass
                await self._publish(bus)
        finally:
            await bus.close()

    async def _publish(self, bus: Bus) -> None:
        beat = self._beat
        if beat is None or not beat_is_fresh(self._offered_at, time.monotonic(), self.stall_s):
            if beat is not None:
                self.withheld += 1
                self._streak += 1
                if self._streak % 10 == 1:
                    log.warning("the node's event loop has not turned for %.0f s: heartbeats withheld",
                                time.monotonic() - (self._offered_at or 0.0))
            return
        self._streak = 0
        try:
            await bus.publish(self.subject, beat.model_copy(update={"ts": time.time()}))
            self.published += 1
        except Exception as exc:
            log.warning("heartbeat failed: %s", exc)
