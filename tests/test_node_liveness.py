"""A node's heartbeats go out from a thread of their own (nodes.server.liveness), against a real
nats-server: a model call that holds the node's loop for seconds does not delay them, and a
loop that stopped turning for good stops them."""

from __future__ import annotations

import asyncio
import time

from bus import subjects
from nodes.server.liveness import HeartbeatThread, beat_is_fresh
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
