"""nats.conf permissions, enforced by a real nats-server."""

from __future__ import annotations

import pytest

from bus import subjects
from bus.client import Bus
from bus.config import DEV_CREDENTIALS
from bus.errors import BusPermissionError
from schemas.base import BusMessage
from schemas.node import NodeHeartbeat
from schemas.rebalance import RebalanceDirective
from schemas.registry import parse_message
from schemas.route import RouteDirective, RouteSession
from tests.fixtures.nats import BusFactory

WAIT = 30.0


def _directive(route_id: str) -> RouteDirective:
    session = RouteSession(
        session_id="s1", route_id=route_id, model="m", model_revision="r", cache_abi="abi",
        n_layer=2, hidden_size=8, n_ctx=64, hops=[],
    )  # fmt: skip
    return RouteDirective(action="abort", session=session, reason="forged", issued_by="node")


async def _collect_until_marker(sub, marker_node: str) -> list[tuple[str, BusMessage]]:  # type: ignore[no-untyped-def]
    got: list[tuple[str, BusMessage]] = []
    async for subject, msg in sub.with_subjects():
        got.append((subject, msg))
        if isinstance(msg, NodeHeartbeat) and msg.node_id == marker_node:
            return got
    return got


async def test_every_role_in_nats_conf_can_connect(bus_factory: BusFactory) -> None:
    for role in DEV_CREDENTIALS:
        bus = await bus_factory(role)
        await bus.flush()
        assert bus.is_connected


async def test_node_cannot_publish_directive_or_rebalance(bus_factory: BusFactory) -> None:
    tracker = await bus_factory("tracker")
    node = await bus_factory("node", name="n1")
    async with tracker.subscribe_any(subjects.ALL) as sub:
        await tracker.flush()
        with pytest.raises(BusPermissionError) as refused:
            await node.publish(subjects.route_directive("Route1"), _directive("Route1"), confirm=True)
        assert refused.value.operation == "publish"
        assert refused.value.subject == "mesh.route.route1.directive"  # nats-py lower-cases errors
        order = RebalanceDirective(node_id="n1", model="m", layer_start=0, layer_end=1, reason="x")
        with pytest.raises(BusPermissionError):
            await node.publish(subjects.rebalance("n1"), order, confirm=True)
        # same connection, so the server handles it after the refused ones: a marker
        await node.publish(subjects.node_heartbeat("marker"), NodeHeartbeat(node_id="marker"))
        got = await _collect_until_marker(sub, "marker")
    assert [s for s, _ in got] == ["mesh.node.marker.heartbeat"]
    assert {p.subject for p in node.permission_errors} == {
        "mesh.route.route1.directive",
        "mesh.tracker.rebalance.n1",
    }
    assert node.is_connected  # a permissions violation does not drop the connection


async def test_gateway_may_close_routes_and_monitor_only_reads(bus_factory: BusFactory) -> None:
    tracker = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    monitor = await bus_factory("monitor")
    async with monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
        await monitor.flush()
        await gateway.publish(subjects.route_directive("r2"), _directive("r2"), confirm=True)
        got = await sub.next(WAIT)
        assert got.session.route_id == "r2"
        with pytest.raises(BusPermissionError):
            await monitor.publish(subjects.node_heartbeat("x"), NodeHeartbeat(node_id="x"), confirm=True)
        with pytest.raises(BusPermissionError):
            await monitor.publish(subjects.route_directive("r3"), _directive("r3"), confirm=True)
    await tracker.publish(subjects.route_directive("r4"), _directive("r4"), confirm=True)
    assert not tracker.permission_errors


async def test_plain_json_is_readable_by_any_client(nats_server) -> None:  # type: ignore[no-untyped-def]
    """What `nats sub 'mesh.>'` prints is the message's JSON with its type."""
    user, password = nats_server.credentials("node")
    bus = await Bus.connect(nats_server.url, user=user, password=password)
    try:
        raw = NodeHeartbeat(node_id="n9", sessions=1).to_json()
        msg = parse_message(raw, "mesh.node.n9.heartbeat")
        assert isinstance(msg, NodeHeartbeat) and msg.sessions == 1
        assert b'"type":"node.heartbeat"' in raw
    finally:
        await bus.close()
