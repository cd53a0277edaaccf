"""The tracker's awake clock: time that passes only while the tracker's own loop runs.

A tracker that is frozen (SIGSTOP, a VM pause, a loop blocked for seconds) hears nobody, yet
its monotonic clock runs on. Judged by that clock, every node would look silent for the whole
pause. The awake clock leaves such pauses out, so a node's silence counts only while the
tracker could have heard it (docs/control-plane.md, "A frozen tracker").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("meshnet.tracker")

WATCH_S = 0.1  # the watch reads the clock this often, so a gap longer than this is a pause
PAUSE_MARGIN_S = 0.5  # loop lateness up to this is scheduling noise, not a pause
BACKLOG_S = 60.0  # what arrived during a pause is read within this much awake time after it


def pause_in(gap_s: float, watch_s: float = WATCH_S, margin_s: float = PAUSE_MARGIN_S) -> float:
    """The part of a gap between two readings of a watched clock that was a pause (pure):
    the gap beyond the watch interval when it exceeds the margin, else 0."""
    late = gap_s - watch_s
    return late if late > margin_s else 0.0


class AwakeClock:
    """`clock()` is `base()` minus every pause seen so far. Pauses are seen only while `watch()`
    runs: before it starts (and after it stops) the clock is `base()` less the pauses so far."""

    def __init__(self, base: Callable[[], float] = time.monotonic, *, watch_s: float = WATCH_S) -> None:
        self.base = base
        self.watch_s = watch_s
        self.paused_s = 0.0  # every pause seen, in all
        self.woke_at = float("-inf")  # awake time when the last pause ended
        self.last_pause_s = 0.0  # the length of the last pause
        self._read_at: float | None = None  # base time of the last reading (watched clocks only)

    def __call__(self) -> float:
        """Awake seconds (a monotonic reading that stands still while the tracker was paused)."""
        t = self.base()
        if self._read_at is not None:
            pause = pause_in(t - self._read_at, self.watch_s)
            if pause:
                self.paused_s += pause
                self.last_pause_s = pause
                self.woke_at = t - self.paused_s
                log.warning("tracker paused for %.1fs (its loop stood still): that time counts for no node's "
                            "silence", pause)
            self._read_at = t
        return t - self.paused_s

    def since_wake(self) -> float:
        """Awake seconds since the last pause ended (inf if none was seen)."""
        return self() - self.woke_at

    def unread_max_s(self, backlog_s: float = BACKLOG_S) -> float:
        """The longest a message read now can have waited unread at this tracker: a running
        loop reads its messages within `backlog_s`; just after a pause, that pause longer."""
        since = self.since_wake()
        return self.last_pause_s + since if since <= backlog_s else backlog_s

    async def watch(self) -> None:
        """Read the clock every `watch_s` until cancelled, so a pause is seen at the first reading
        after it, whoever reads first."""
        self._read_at = self.base()
        try:
            while True:
                await asyncio.sleep(self.watch_s)
                self()
        finally:
            self._read_at = None
