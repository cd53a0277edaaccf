"""A distant bus: parts whose NATS server is a long round trip away (a DelayRelay in front of it).

Route asks are the control round trips a request awaits; these tests put trackers and the
gateway's router far from the server and check that the waits on them count the round trips
they take (bus/rtt.py) instead of timing out on a loopback budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest

from bench.relay import DelayRelay
from bus import subjects
from bus.client import Bus
from bus.rtt import BusRtt, measure_rtt
from bus.server import NatsServer
from gateway.mesh_view import MeshView
from gateway.routing import ATTEMPT_S, FIRST_ASK_S, Router, ask_waits
from nodes.server.driver_watch import DriverWatch
from schemas.route import RouteRequest
from schemas.tracker import TrackerStatus
from tests.fixtures.nats import BusFactory
from tests.test_driver_watch import _Table
from tests.test_gateway_queue import until
from tests.test_tracker_group import CONFIG, CountingBus, fake_nodes, tracker, until_live
from tracker.node_events import answer_wait_s
from tracker.service import Tracker

FAR_DELAY_S = 0.15  # each way: a 300 ms round trip between a far part and the server


@pytest.fixture
async def far_url(nats_server: NatsServer) -> AsyncIterator[str]:
    """The server's client port behind a relay that delays each direction by FAR_DELAY_S."""
    async with DelayRelay("127.0.0.1", nats_server.port, FAR_DELAY_S) as relay:
        yield f"nats://127.0.0.1:{relay.port}"


async def far_bus(nats_server: NatsServer, url: str, role: str, name: str) -> Bus:
    user, password = nats_server.credentials(role)
    return await Bus.connect(url, role=role, user=user, password=password, name=name)


async def test_a_round_trip_is_measured_through_a_far_bus(nats_server: NatsServer, far_url: str) -> None:
    bus = await far_bus(nats_server, far_url, "tracker", "far-rtt")
    try:
        rtt = BusRtt()
        assert rtt.seconds() == 0.0
        took = await measure_rtt(bus, rtt)
        assert took is not None and took >= 2 * FAR_DELAY_S and rtt.seconds() == took
    finally:
        await bus.close()


async def test_a_far_tracker_claims_its_asks_so_copies_of_one_ask_are_one_route(
        bus_factory: BusFactory, nats_server: NatsServer, far_url: str) -> None:
    """Two trackers read copies of one ask (a retry reaches every tracker); the far one's claim
    takes a 300 ms round trip. It must wait for it and give the near one's route back: before,
    its claim timed out after 0.1 s and it opened a second route for the same ask."""
    far = Tracker(await far_bus(nats_server, far_url, "tracker", "far"), dataclasses.replace(CONFIG, tracker_id="far"))
    async with fake_nodes(bus_factory, {"fh": (0, 15), "ft": (15, 30)}), \
            await tracker(bus_factory, "near") as near, far:
        await until_live({"fh", "ft"}, near, far)
        assert far.rtt.seconds() >= 2 * FAR_DELAY_S  # measured before it served
        req = RouteRequest(model="smol", request_id="far-copies")
        first = await near.handle_route_request(req)
        again = await far.handle_route_request(req)
        assert first.session is not None and again.session is not None
        assert again.session.route_id == first.session.route_id and again.credentials == first.credentials
        assert far.status().bus_rtt_ms >= 2000 * FAR_DELAY_S  # it tells the gateways what its asks cost
        await asyncio.sleep(2 * FAR_DELAY_S + 0.3)
        assert list(near.sessions) == list(far.sessions) == [first.session.route_id]  # one route, counted by both


def test_a_route_asks_waits_count_the_round_trips_its_answer_crosses() -> None:
    assert ask_waits(0.0, 0.0) == (FIRST_ASK_S, ATTEMPT_S)  # loopback: as before
    first, retry = ask_waits(0.3, 0.3)  # the bus 300 ms from the gateway and from the tracker
    assert first == pytest.approx(FIRST_ASK_S + 0.3 + 0.6) and retry == pytest.approx(ATTEMPT_S + 0.3 + 1.2)


async def test_a_gateway_and_a_tracker_far_from_the_bus_get_a_route_in_one_ask(
        nats_server: NatsServer, bus_factory: BusFactory, far_url: str) -> None:
    """Gateway and tracker each 300 ms from the server: the answer crosses the gateway's round
    trip, the tracker's, and its claim's (about 0.9 s in all). The first ask must wait for it:
    before, it gave up after 0.5 s and asked every tracker again, on every request (the retry's
    answer came 0.9 s later still)."""
    far = Tracker(await far_bus(nats_server, far_url, "tracker", "far-t"),
                  dataclasses.replace(CONFIG, tracker_id="far-t", status_interval=0.2))
    gateway = CountingBus(await far_bus(nats_server, far_url, "gateway", "far-gw"))
    view, own = MeshView(), BusRtt()
    async with fake_nodes(bus_factory, {"gh": (0, 15), "gt": (15, 30)}), far, gateway.bus, \
            gateway.bus.subscribe(subjects.TRACKER_STATUS, TrackerStatus) as statuses:
        await until_live({"gh", "gt"}, far)
        await measure_rtt(gateway.bus, own)
        async for status in statuses:  # the gateway reads what the tracker's round trip is
            view.on_status(status)
            if status.bus_rtt_ms:
                break
        router = Router(gateway, timeout=10.0, bus_rtt=lambda: (own.seconds(), view.tracker_rtt_s()))
        for k in range(2):
            before = len(gateway.asks)
            session = await router.create(RouteRequest(model="smol", session_id=f"far-{k}"))
            assert [h.node_id for h in session.hops] == ["gh", "gt"]
            assert gateway.asks[before:] == [subjects.ROUTE_CREATE]  # answered, not asked again


def test_the_round_trip_before_an_expiry_may_take_the_round_trips_measured_before() -> None:
    assert answer_wait_s(3.0, 0.0) == pytest.approx(1.0)  # loopback: as before
    assert answer_wait_s(1.5, 0.0) == pytest.approx(0.5)
    assert answer_wait_s(3.0, 0.6) == pytest.approx(2.2)


async def test_a_far_tracker_expires_a_silent_node(bus_factory: BusFactory, nats_server: NatsServer) -> None:
    """The tracker 600 ms from its server asks for a round trip before it expires a node (a
    partition would look the same as a silent node). With its 1.5 s expiry that round trip was
    given 0.5 s, so it never came in time: the silent node was never expired."""
    async with DelayRelay("127.0.0.1", nats_server.port, 0.3) as relay:
        far = Tracker(await far_bus(nats_server, f"nats://127.0.0.1:{relay.port}", "tracker", "far-x"),
                      dataclasses.replace(CONFIG, tracker_id="far-x"))
        async with fake_nodes(bus_factory, {"xh": (0, 15), "xt": (15, 30)}) as (head, _), far:
            await until_live({"xh", "xt"}, far)
            await head.stop_heartbeats()

            async def expired() -> bool:
                return far.registry.get("xh") is None

            await until(expired, "the far tracker's expiry of the silent node xh (1.5 s of silence, then a round trip)")
            assert far.registry.get("xt") is not None


async def test_a_node_far_from_the_bus_frees_the_sessions_of_a_driver_gone_silent(nats_server: NatsServer) -> None:
    """A node 1.2 s from its server asks for a round trip before it frees the sessions of a
    silent gateway (its own silence would look the same). That round trip was given 1 s, so it
    never came in time and such sessions waited for their idle lease (600 s)."""
    async with DelayRelay("127.0.0.1", nats_server.port, 0.6) as relay:
        user, password = nats_server.credentials("node", node_id="far-n")
        bus = await Bus.connect(f"nats://127.0.0.1:{relay.port}", role="node", user=user, password=password,
                                name="far-n", node_id="far-n")
        try:
            table = _Table(opened_at=time.monotonic() - 30)
            watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]
            watch.seen["gw-1"] = time.monotonic() - 20  # its driver went silent 20 s ago
            assert await measure_rtt(bus, watch.rtt) is not None  # as each check does
            assert await watch.check() == ["s1"] and table.ended == ["s1"]
        finally:
            await bus.close()
