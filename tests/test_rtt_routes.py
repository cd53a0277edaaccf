"""Routes that know the network: real nodes measure their round trips to the nodes after them,
and the tracker sends sessions to the near replica of a range when the replicas differ only in
how far away they are."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bus import subjects
from schemas.route import RoutePolicy, RouteReply, RouteRequest
from tests.fixtures.wan import FarMesh
from tracker.spread import SpreadSession, plan_spread
from tracker.views import NodeView
from wire.rtt_probe import RttProbe

NEAR_S, FAR_S = 0.001, 0.1  # one-way delays in front of the two tails: RTT 2 ms and 200 ms


async def test_routes_go_to_the_near_replica_of_a_range(far_mesh: FarMesh) -> None:
    mesh = far_mesh.mesh
    head = await mesh.spawn((0, 15))
    far = await far_mesh.spawn((15, 30), delay_s=FAR_S)  # first: a tie of costs would go to its node id
    near = await far_mesh.spawn((15, 30), delay_s=NEAR_S)

    def head_view() -> NodeView | None:
        """The head as the tracker's route index has it (rebuilt at most every 0.5 s)."""
        entry = mesh.tracker.routes.index(mesh.tracker.clock()).nodes.get(head.node_id)
        return entry[1].view if entry is not None else None

    async with asyncio.timeout(120):  # a guard: the probes run every 2 s
        while True:
            view = head_view()
            if view is not None and {near.node_id, far.node_id} <= set(view.peer_rtt_ms) \
                    and {head.node_id, near.node_id, far.node_id} <= set(mesh.tracker.book.live):
                break
            await asyncio.sleep(0.2)
    rtt = view.peer_rtt_ms
    assert rtt[far.node_id] >= 2 * FAR_S * 1e3 * 0.9, rtt  # the relay's delay, there and back
    assert rtt[near.node_id] < rtt[far.node_id] / 2, rtt
    # the tracker lists every node with its URL: that is where the head learned both tails from
    listed = {n.node_id: n.activation_url for n in mesh.tracker.status().nodes}
    assert listed[far.node_id].endswith(f":{far_mesh.relays[0].port}")

    allow = RoutePolicy(kind="private", allow_nodes=[head.node_id, near.node_id, far.node_id])
    tails = []
    for _ in range(3):  # held open: the near tail stays cheaper with a few sessions on it
        request = RouteRequest(model=mesh.model_name, policy=allow, head_rtt_ms={head.node_id: 3.0})
        reply = await mesh.bus.request(subjects.ROUTE_CREATE, request, RouteReply, timeout=5.0)
        assert reply.session is not None, reply.error
        tails.append(reply.session.hops[1].node_id)
        # the gateway's round trips go with the route, so every tracker (and one reading the
        # session bucket after a restart) prices a head's move with them
        assert reply.session.head_rtt_ms == {head.node_id: 3.0}
    assert tails == [near.node_id] * 3
    # and the spreader leaves them there: 3 against 0 would even out between near replicas, but a
    # move here adds the far tail's trip to every token (tracker/spread.py, move_pays)
    book = mesh.tracker.book
    sessions = [SpreadSession(a.session.route_id, a.opened_at, tuple(h.node_id for h in a.session.hops),
                              a.session.head_rtt_ms) for a in book.sessions.values()]
    assert len(sessions) == 3
    assert plan_spread(book.views(), sessions, live=book.live, now=book.clock() + 10.0) == []


async def test_a_head_far_from_the_gateway_but_near_its_tail_wins(far_mesh: FarMesh) -> None:
    """Two chains of two hops: h-a is 200 ms from the gateway and its tail next to it; h-b is next
    to the gateway and 200 ms from its tail. The gateway measures its round trips to the heads
    from its side (its own RttProbe, as gateway/head_probe.py runs it) and the route takes h-a:
    the gateway pays its trip once per prefill frame and Decode Run, every token the far seam.
    (Counted per token, the gateway's trip sent the route to h-b.)"""
    mesh = far_mesh.mesh
    head_a = await far_mesh.spawn((0, 15), delay_s=FAR_S)
    tail_a = await mesh.spawn((15, 30))
    head_b = await mesh.spawn((0, 10))
    tail_b = await far_mesh.spawn((10, 30), delay_s=FAR_S)
    nodes = [head_a, tail_a, head_b, tail_b]
    gateway = RttProbe()

    def measured() -> bool:
        index = mesh.tracker.routes.index(mesh.tracker.clock())
        views = {n: e[1].view for n, e in index.nodes.items()}
        return (head_a.node_id in views and tail_a.node_id in views[head_a.node_id].peer_rtt_ms
                and head_b.node_id in views and tail_b.node_id in views[head_b.node_id].peer_rtt_ms
                and {head_a.node_id, head_b.node_id} <= set(gateway.rtt_ms())
                and {n.node_id for n in nodes} <= set(mesh.tracker.book.live))

    async with asyncio.timeout(120):  # a guard: the probes run every 2 s
        while not measured():
            listed = {n.node_id: n.activation_url for n in mesh.tracker.status().nodes}
            gateway.name({n.node_id: listed[n.node_id] for n in (head_a, head_b) if n.node_id in listed})
            await gateway.probe_once(mesh.http)
            await asyncio.sleep(0.5)
    head_rtt = gateway.rtt_ms()
    assert head_rtt[head_a.node_id] >= 2 * FAR_S * 1e3 * 0.9, head_rtt  # the relay, there and back
    assert head_rtt[head_b.node_id] < head_rtt[head_a.node_id] / 2, head_rtt
    allow = RoutePolicy(kind="private", allow_nodes=[n.node_id for n in nodes])
    request = RouteRequest(model=mesh.model_name, policy=allow, prompt_tokens=40, head_rtt_ms=head_rtt)
    reply = await mesh.bus.request(subjects.ROUTE_CREATE, request, RouteReply, timeout=5.0)
    assert reply.session is not None, reply.error
    assert [h.node_id for h in reply.session.hops] == [head_a.node_id, tail_a.node_id]


async def test_new_routes_leave_a_tail_whose_link_degrades_and_come_back_when_it_recovers(
        far_mesh: FarMesh) -> None:
    """Two tails, A at RTT 10 ms and B at 100 ms from the head. A's link degrades to 200 ms mid-run
    (its relay's delay changes): the head's estimate follows once its last SAMPLES round trips
    are all slow, and new routes go to B while the session opened on A stays there; A recovers,
    and the next probe sends new routes back to it."""
    mesh = far_mesh.mesh
    head = await mesh.spawn((0, 15))
    a = await far_mesh.spawn((15, 30), delay_s=0.005)
    b = await far_mesh.spawn((15, 30), delay_s=0.05)
    listed = {n.node_id: n.activation_url for n in mesh.tracker.status().nodes}
    relay_a = next(r for r in far_mesh.relays if listed[a.node_id].endswith(f":{r.port}"))

    def rtt() -> dict[str, float]:
        entry = mesh.tracker.routes.index(mesh.tracker.clock()).nodes.get(head.node_id)
        return dict(entry[1].view.peer_rtt_ms) if entry is not None else {}

    async def until(measured: Callable[[dict[str, float]], bool]) -> None:
        async with asyncio.timeout(120):  # a guard: the probes run every 2 s
            while True:
                if {a.node_id, b.node_id} <= set(rtt()) and measured(rtt()):
                    return
                await asyncio.sleep(0.2)

    async def tail() -> str:
        allow = RoutePolicy(kind="private", allow_nodes=[head.node_id, a.node_id, b.node_id])
        reply = await mesh.bus.request(subjects.ROUTE_CREATE, RouteRequest(model=mesh.model_name, policy=allow),
                                       RouteReply, timeout=5.0)
        assert reply.session is not None, reply.error
        return reply.session.hops[1].node_id

    await until(lambda r: r[a.node_id] < r[b.node_id])
    assert await tail() == a.node_id
    relay_a.delay_s = 0.1
    await until(lambda r: r[a.node_id] > r[b.node_id])
    assert rtt()[a.node_id] >= 200 * 0.9, rtt()
    assert await tail() == b.node_id
    assert sorted(s.session.hops[1].node_id for s in mesh.tracker.book.sessions.values()) \
        == sorted([a.node_id, b.node_id])  # the session opened on A stays on its route
    relay_a.delay_s = 0.005
    await until(lambda r: r[a.node_id] < r[b.node_id])
    assert await tail() == a.node_id
