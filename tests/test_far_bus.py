"""A distant bus: parts whose NATS server is a long round trip away (a DelayRelay in front of it).

Route asks are the control round trips a request awaits; these tests put trackers and the
gateway's router far from the server and check that the waits on them count the round trips
they take (bus/rtt.py) instead of timing out on a loopback budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from bench.relay import DelayRelay
from bus.client import Bus
from bus.rtt import BusRtt, measure_rtt
from bus.server import NatsServer
from schemas.route import RouteRequest
from tests.fixtures.nats import BusFactory
from tests.test_tracker_group import CONFIG, fake_nodes, tracker, until_live
from tracker.asks import claim_wait_s
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


def test_a_claim_waits_for_the_round_trips_it_takes() -> None:
    assert claim_wait_s(0.0) == pytest.approx(0.1)
    assert claim_wait_s(0.3) == pytest.approx(1.0)  # a create, nats-py's look at the key, the read of the claim


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

