"""A node's heartbeats go out from a thread of their own (nodes.server.liveness), against a real
nats-server: a model call that holds the node's loop for seconds does not delay them, and a
loop that stopped turning for good stops them."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from bus import subjects
from nodes.server import liveness
from nodes.server.liveness import HeartbeatThread, beat_is_fresh, next_tick
from schemas.node import NodeHeartbeat
from tests.fixtures.nats import BusFactory


def test_a_beat_vouches_for_the_loop_only_while_fresh() -> None:
    assert beat_is_fresh(10.0, 19.0, 10.0)
    assert not beat_is_fresh(10.0, 20.5, 10.0)
    assert not beat_is_fresh(None, 0.0, 10.0)


async def test_heartbeats_leave_on_time_while_the_loop_is_blocked(bus_factory: BusFactory) -> None:
    node_bus = await bus_factory("node", name="n1")
    monitor = await bus_factory("monitor")
    sender = HeartbeatThread(node_bus, subjects.node_heartbeat("n1"), interval_s=0.2)
    sender.offer(NodeHeartbeat(node_id="n1", sessions=3))
    async with monitor.subscribe(subjects.node_heartbeat("n1"), NodeHeartbeat) as sub:
        await asyncio.to_thread(sender.start)
        try:
            blocked_from = time.time()
            time.sleep(1.5)  # noqa: ASYNC251 - stands for a model call on the loop's thread (ctypes releases the GIL too)
            blocked_to = time.time()
            stamps = []
            async with asyncio.timeout(5):
                async for hb in sub:
                    stamps.append(hb.ts)
                    if hb.ts > blocked_to:
                        break
        finally:
            await asyncio.to_thread(sender.stop)
    during = [t for t in stamps if blocked_from <= t <= blocked_to]
    assert len(during) >= 3, stamps  # about one per 0.2 s while the loop was held; none without the thread
    assert sender.withheld == 0


async def test_a_loop_that_stopped_offering_gets_no_heartbeats(bus_factory: BusFactory) -> None:
    node_bus = await bus_factory("node", name="n2")
    monitor = await bus_factory("monitor")
    sender = HeartbeatThread(node_bus, subjects.node_heartbeat("n2"), interval_s=0.1, stall_s=0.3)
    sender.offer(NodeHeartbeat(node_id="n2"))
    async with monitor.subscribe(subjects.node_heartbeat("n2"), NodeHeartbeat) as sub:
        await asyncio.to_thread(sender.start)
        try:
            await asyncio.sleep(1.0)  # the loop turns but no longer offers: it is wedged
            assert sender.withheld >= 3 and sender.published <= 4
            published = sender.published
            await asyncio.sleep(0.3)
            assert sender.published == published  # quiet while nothing fresh is offered
            sender.offer(NodeHeartbeat(node_id="n2", sessions=1))
            async with asyncio.timeout(5):
                async for hb in sub:
                    if hb.sessions == 1:
                        break  # offering again resumes the heartbeats
        finally:
            await asyncio.to_thread(sender.stop)


def test_ticks_missed_while_frozen_are_skipped() -> None:
    assert next_tick(10.0, 10.01, 1.0) == 11.0  # on time: one interval on
    assert next_tick(10.0, 41.0, 1.0) == 41.0  # 30 s frozen: due now, once, not 30 times


async def test_a_frozen_process_sends_no_burst_of_heartbeats_when_it_wakes(
        bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP freezes the loop and the heartbeat thread alike; on SIGCONT the monotonic clock
    has moved on by the freeze. Stand-in: the module's monotonic clock jumps 30 s while the loop keeps
    offering. Before, the thread made up every missed interval at once (300 here)."""
    node_bus = await bus_factory("node", name="n3")
    sender = HeartbeatThread(node_bus, subjects.node_heartbeat("n3"), interval_s=0.1, stall_s=0.3)
    jump = [0.0]
    monkeypatch.setattr(liveness, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + jump[0],
                                                          time=time.time))
    sender.offer(NodeHeartbeat(node_id="n3"))
    await asyncio.to_thread(sender.start)
    try:
        await asyncio.sleep(0.35)
        before = sender.published + sender.withheld
        jump[0] = 30.0
        for _ in range(10):
            sender.offer(NodeHeartbeat(node_id="n3"))
            await asyncio.sleep(0.05)
        ticks = sender.published + sender.withheld - before
    finally:
        await asyncio.to_thread(sender.stop)
    assert ticks <= 10, f"{ticks} heartbeats (sent or withheld) in 0.5 s after the freeze"
