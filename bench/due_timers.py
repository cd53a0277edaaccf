"""Wake-ups at exact monotonic times for one event loop: the relay's clock (bench/relay.py).

A loop's own timers count whole milliseconds and wake a sleeping process late: measured through
the WAN emulation (3 hops at RTT 20 ms), a relayed chunk left its relay 0.14-0.25 ms after its
due time on average, with a tail past 1 ms, and one stream paid that on every crossing of its
token. On Linux `DueTimers` arms one timerfd (the kernel's timer, to the nanosecond) at the
earliest due time and lets the loop watch it: the same chunks left 0.06-0.09 ms late
(docs/benchmarks.md, "A relay that keeps its time"). Elsewhere it falls back to loop timers.
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import sys
import time
from collections.abc import Callable

__all__ = ["DueTimers", "Wake"]

_CLOCK_MONOTONIC = 1  # time.monotonic's clock on Linux
_TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = 0o4000, 0o2000000, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _timerfd() -> tuple[int, Callable[[float], None]] | None:
    """A non-blocking timerfd and a function that arms it at a monotonic time, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
    except (OSError, AttributeError):
        return None
    if fd < 0:
        return None

    def arm(due: float) -> None:
        ns = max(1, int(due * 1e9))  # (a zero time would disarm it)
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(ns // 1_000_000_000, ns % 1_000_000_000))
        if libc.timerfd_settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")

    return fd, arm


class Wake:
    """One requested wake-up; cancel() makes it a no-op."""

    __slots__ = ("callback", "cancelled", "due")

    def __init__(self, due: float, callback: Callable[[], None]) -> None:
        self.due, self.callback, self.cancelled = due, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class DueTimers:
    """`at(due, callback)` calls `callback` in the loop at monotonic time `due` (never before
    `due - resolution / 2`); one kernel timer serves every wake-up. close() releases it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._heap: list[tuple[float, int, Wake]] = []
        self._seq = itertools.count()
        self._armed_at: float | None = None
        self._firing = False
        self._closed = False
        self._handle: asyncio.TimerHandle | None = None
        self._fd = _timerfd()
        if self._fd is not None:
            loop.add_reader(self._fd[0], self._fired)
        # loop timers count whole milliseconds (uvloop rounds to the nearest): never one shorter
        # than 1 ms, and a wake-up takes what is due within half of one
        self.resolution = 20e-6 if self._fd is not None else 1e-3

    def at(self, due: float, callback: Callable[[], None]) -> Wake:
        wake = Wake(due, callback)
        if self._closed:  # (a relay's last callbacks after its close: nothing runs)
            wake.cancel()
            return wake
        heapq.heappush(self._heap, (due, next(self._seq), wake))
        if not self._firing and (self._armed_at is None or due < self._armed_at):
            self._arm(self._heap[0][0])
        return wake

    def close(self) -> None:
        self._closed = True
        self._heap.clear()
        if self._handle is not None:
            self._handle.cancel()
        if self._fd is not None:
            if not self.loop.is_closed():  # (a closed loop has no readers left)
                self.loop.remove_reader(self._fd[0])
            os.close(self._fd[0])
            self._fd = None

    def _arm(self, due: float) -> None:
        self._armed_at = due
        if self._fd is not None:
            self._fd[1](due)
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self.loop.call_later(max(1e-3, due - time.monotonic()), self._fired)

    def _fired(self) -> None:
        if self._fd is not None:
            try:
                os.read(self._fd[0], 8)
            except BlockingIOError:  # re-armed after it fired: not due yet
                return
        self._armed_at, self._handle, self._firing = None, None, True
        now = time.monotonic() + self.resolution / 2
        while self._heap and self._heap[0][0] <= now:
            _, _, wake = heapq.heappop(self._heap)
            if wake.cancelled:
                continue
            try:
                wake.callback()
            except Exception as exc:  # one failing wake-up must not strand the others
                self.loop.call_exception_handler({"message": "a DueTimers wake-up failed", "exception": exc})
        self._firing = False
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        if self._heap:
            self._arm(self._heap[0][0])
