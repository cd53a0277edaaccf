"""Audit events survive a nats-server restart: JetStream ack + retry with backoff, de-duplicated;
while the server is away an event waits for the reconnect instead of using up its retries."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bus.client import AUDIT_STREAM
from bus.jetstream import read_recent
from bus.server import NatsServer
from schemas.audit import NodeWork, RouteParticipation
from tests.fixtures.nats import BusFactory


def _event(i: int) -> NodeWork:
    return NodeWork(
        source="n1", session_id=f"s{i}", route_id=f"r{i}", node_id="n1", model_revision="rev",
        layer_start=0, layer_end=15, prefill_tokens=i, decode_tokens=1,
    )  # fmt: skip


async def test_audit_events_published_across_a_restart_are_all_stored(
    nats_server: NatsServer, bus_factory: BusFactory, caplog: pytest.LogCaptureFixture
) -> None:
    node = await bus_factory("node", name="n1")
    tracker = await bus_factory("tracker")
    first = [await node.publish_audit(_event(i)) for i in range(5)]
    assert first == [1, 2, 3, 4, 5]

    events = [_event(i) for i in range(5, 45)]
    await nats_server.stop()  # a restart, with events published while the server is down
    # whatever the ack timeout, each waits for the reconnect (or times out and retries if it
    # was sent before the client saw the server go)
    publishing = asyncio.gather(
        *(node.publish_audit(e, ack_timeout=2.0 if i % 2 else 0.1) for i, e in enumerate(events[:20]))
    )
    await asyncio.sleep(0.5)
    await nats_server.resume()
    await publishing
    more = await asyncio.gather(*(node.publish_audit(e) for e in events[20:]))
    assert len(set(more)) == 20

    assert await tracker.audit_count() == 45
    stored = await tracker.audit_messages()
    ids = [m["event_id"] for m in stored]
    assert len(set(ids)) == 45  # no duplicates despite retries
    assert {m["work_units"] for m in stored} == {(i + 1) * 15 for i in range(45)}
    assert await tracker.audit_count("mesh.audit.node_work.>") == 45
    assert await tracker.audit_count("mesh.audit.node_work.node.n1") == 45  # who published it


async def test_audit_retry_is_deduplicated_by_event_id(bus_factory: BusFactory) -> None:
    node = await bus_factory("node", name="n1")
    tracker = await bus_factory("tracker")
    event = RouteParticipation(
        source="n1", session_id="s", route_id="r", model="m", model_revision="rev",
        cache_abi="abi", node_id="n1", layer_start=0, layer_end=30, hop_index=0, n_hops=1,
    )  # fmt: skip
    seq1 = await node.publish_audit(event)
    seq2 = await node.publish_audit(event)  # same event_id: JetStream keeps one copy
    assert seq1 == seq2
    assert await tracker.audit_count() == 1
    info = await tracker._js.stream_info(AUDIT_STREAM)
    assert info.config.subjects == ["mesh.audit.>"]


async def test_an_outage_longer_than_every_retry_uses_none_of_them(
    nats_server: NatsServer, bus_factory: BusFactory, caplog: pytest.LogCaptureFixture
) -> None:
    node = await bus_factory("node", name="n1")
    tracker = await bus_factory("tracker")
    await node.publish_audit(_event(0))
    caplog.set_level(logging.INFO, logger="meshnet.bus")
    await nats_server.stop()
    for _ in range(500):  # until the client has seen the server go
        if not node.is_connected:
            break
        await asyncio.sleep(0.01)
    # two tries of 0.1 s would be spent in a fraction of the outage, were they counted
    publishing = asyncio.gather(*(node.publish_audit(_event(i), attempts=2, ack_timeout=0.1) for i in range(1, 6)))
    await asyncio.sleep(1.5)
    assert not publishing.done()  # waiting for the server, not failing
    await nats_server.resume()
    assert len(set(await publishing)) == 5
    assert not any("attempt" in r.getMessage() for r in caplog.records)  # no try while it was away
    assert await tracker.audit_count() == 6


async def test_read_recent_gives_the_last_events_of_one_subject_oldest_first(bus_factory: BusFactory) -> None:
    node = await bus_factory("node", name="n1")
    tracker = await bus_factory("tracker")
    sparse = []  # (stream sequence, session id) of the events on the subject read back
    for i in range(60):
        await node.publish_audit(_event(i))
        if i % 6 == 0:  # one route participation in six events: the window widens to find four
            event = RouteParticipation(
                source="n1", session_id=f"p{i}", route_id="r", model="m", model_revision="rev",
                cache_abi="abi", node_id="n1", layer_start=0, layer_end=30, hop_index=0, n_hops=1,
            )  # fmt: skip
            sparse.append((await node.publish_audit(event), event.session_id))
    subject = "mesh.audit.route_participation.>"
    recent = await read_recent(tracker, subject, 4)
    assert [(e.seq, e.data["session_id"]) for e in recent] == sparse[-4:]
    assert [(e.seq, e.data["session_id"]) for e in await read_recent(tracker, subject, 50)] == sparse
    assert await read_recent(tracker, "mesh.audit.validation_verdict.validator", 4) == []
    assert (await tracker._js.stream_info(AUDIT_STREAM)).state.consumer_count == 0  # none left behind
