"""bench/due_timers.py: wake-ups at monotonic times, on a timerfd (Linux) or on loop timers."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

import bench.due_timers as due_timers
from bench.due_timers import DueTimers

WAIT_S = 30.0  # bounded waits: a hang fails with a message, never a wall-clock limit on speed


def _open_fds() -> int:
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counts open files from /proc")
    return len(os.listdir("/proc/self/fd"))


async def _wakes_in_order_never_early(timers: DueTimers) -> None:
    t0 = time.monotonic()
    fired: list[tuple[str, float]] = []
    done = asyncio.Event()
    dues = {"c": t0 + 0.030, "a": t0 + 0.010, "b": t0 + 0.020}
    for name, due in dues.items():
        timers.at(due, lambda n=name: fired.append((n, time.monotonic())))
    timers.at(t0 + 0.015, lambda: fired.append(("cancelled", 0.0))).cancel()
    timers.at(t0 + 0.040, done.set)
    await asyncio.wait_for(done.wait(), WAIT_S)
    assert [n for n, _ in fired] == ["a", "b", "c"]
    for name, at in fired:
        assert at >= dues[name] - timers.resolution / 2


async def _a_wake_may_ask_for_another(timers: DueTimers) -> None:
    done = asyncio.Event()
    timers.at(time.monotonic() + 0.005, lambda: timers.at(time.monotonic() + 0.005, done.set))
    await asyncio.wait_for(done.wait(), WAIT_S)


@pytest.mark.parametrize("kernel_timer", [True, False], ids=["timerfd", "loop-timers"])
async def test_wakes_come_in_due_order_and_never_early(kernel_timer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not kernel_timer:
        monkeypatch.setattr(due_timers, "_timerfd", lambda: None)
    timers = DueTimers(asyncio.get_running_loop())
    if kernel_timer and timers.resolution == 1e-3:
        pytest.skip("no timerfd on this platform")
    try:
        await _wakes_in_order_never_early(timers)
        await _a_wake_may_ask_for_another(timers)
    finally:
        timers.close()


async def test_close_releases_the_timer_and_runs_nothing_after() -> None:
    before = _open_fds()
    timers = DueTimers(asyncio.get_running_loop())
    fired: list[str] = []
    timers.at(time.monotonic() + 0.005, lambda: fired.append("before close"))
    timers.close()
    assert _open_fds() == before
    timers.at(time.monotonic(), lambda: fired.append("after close"))
    await asyncio.sleep(0.02)
    assert fired == []


async def test_a_failing_wake_up_strands_no_other() -> None:
    loop = asyncio.get_running_loop()
    failures: list[dict] = []
    loop.set_exception_handler(lambda _, context: failures.append(context))
    timers = DueTimers(loop)
    fired: list[str] = []
    done = asyncio.Event()
    t0 = time.monotonic()

    def boom() -> None:
        raise RuntimeError("boom")

    try:
        timers.at(t0 + 0.005, boom)
        timers.at(t0 + 0.005, lambda: fired.append("same time"))
        timers.at(t0 + 0.015, done.set)
        await asyncio.wait_for(done.wait(), WAIT_S)
    finally:
        timers.close()
        loop.set_exception_handler(None)
    assert fired == ["same time"] and isinstance(failures[0]["exception"], RuntimeError)


async def test_a_relay_that_cannot_bind_leaves_no_timer() -> None:
    from bench.relay import DelayRelay

    async with DelayRelay("127.0.0.1", 9, 0.01) as taken:
        before = _open_fds()
        with pytest.raises(OSError):
            await DelayRelay("127.0.0.1", 9, 0.01, port=taken.port).start()
        assert _open_fds() == before


def test_wakes_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        timers = DueTimers(asyncio.get_running_loop())
        try:
            await _wakes_in_order_never_early(timers)
        finally:
            timers.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
