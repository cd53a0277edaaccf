"""Spreading sessions over a range's replicas (tracker/spread.py): the plan, and a real move.

The plan is pure and tested as a table. The move runs on a real mesh as in
tests/test_restart_keep.py (nats-server, an in-process tracker, the gateway, four node
processes: two replicas of each half of the bundled model): the tracker orders a decoding
session off one of its hops; the gateway leaves that hop, keeps the other (a Kept Hop) and the
answer goes on, equal to single-process llama.cpp's uninterrupted greedy answer, while the
node it left frees the session at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from schemas.route import RouteDirective
from tests.test_concurrent_serving import stream_chat
from tests.test_gateway_e2e import Mesh, Reference, load_reference
from tests.test_restart import (
    MAX_TOKENS,
    STORY,
    gateway_counter,
    restart_mesh,
    route_nodes,
    session_events,
)
from tests.test_restart_keep import node_url
from tracker.spread import Move, SpreadConfig, SpreadSession, plan_spread
from tracker.views import NodeView

NODES = {"sp-head-a": "0:15", "sp-head-b": "0:15", "sp-tail-a": "15:30", "sp-tail-b": "15:30"}


def view(node_id: str, start: int, end: int, tps: float = 100.0, free: int = 8) -> NodeView:
    return NodeView(node_id=node_id, activation_url=f"http://{node_id}", model="m", model_revision="r",
                    cache_abi="c", start=start, end=end, n_layer=30, decode_tps=tps, free_slots=free)


VIEWS = [view("h1", 0, 15), view("h2", 0, 15), view("t1", 15, 30), view("t2", 15, 30)]
LIVE = {"h1": 8, "h2": 8, "t1": 8, "t2": 8}


def sessions_on(head: str, tail: str, n: int, first_opened: float = 0.0, prefix: str = "r") -> list[SpreadSession]:
    return [SpreadSession(f"{prefix}{i}", first_opened + i, (head, tail)) for i in range(n)]


def moved(moves: list[Move]) -> list[tuple[str, str, str]]:
    return [(m.route_id, m.from_node, m.to_node) for m in moves]


@pytest.mark.parametrize(("name", "sessions", "kwargs", "want"), [
    ("balanced: nothing moves", sessions_on("h1", "t1", 4) + sessions_on("h2", "t2", 4, prefix="s"), {}, []),
    ("a gap of 1 is left alone", sessions_on("h1", "t1", 3) + sessions_on("h2", "t2", 2, prefix="s"), {}, []),
    # 8 on the survivor h1 (tails already even): the 4 youngest move to h2
    ("after a head's return, the youngest move",
     [SpreadSession(f"r{i}", float(i), ("h1", "t1" if i % 2 else "t2")) for i in range(8)], {},
     [("r7", "h1", "h2"), ("r6", "h1", "h2"), ("r5", "h1", "h2"), ("r4", "h1", "h2")]),
    # both halves uneven: each session moves at most once per round
    ("one move per session per round", sessions_on("h1", "t1", 2), {},
     [("r1", "h1", "h2"), ("r0", "t1", "t2")]),
    ("too young to be decoding", sessions_on("h1", "t1", 4, first_opened=9.5), {}, []),
    ("a range cooling after moves", sessions_on("h1", "t1", 4),
     {"cooling": [("r", "c", 0, 15), ("r", "c", 15, 30)]}, []),
    # two ordered off h1 already count as on h2: nothing more for the heads; the tails move
    # others (an order in flight is one range's)
    ("already ordered to move", sessions_on("h1", "t1", 4), {"moving": {"r3": "h1", "r2": "h1"}},
     [("r1", "t1", "t2"), ("r0", "t1", "t2")]),
])
def test_plan_spread(name: str, sessions: list[SpreadSession], kwargs: dict[str, object],
                     want: list[tuple[str, str, str]]) -> None:
    assert moved(plan_spread(VIEWS, sessions, live=LIVE, now=10.0, **kwargs)) == want, name  # type: ignore[arg-type]


def test_plan_spread_never_moves_onto_a_straggler_a_full_node_or_off_a_route_with_a_dead_hop() -> None:
    sessions = sessions_on("h1", "t1", 4)
    slow = [view("h1", 0, 15), view("h2", 0, 15, tps=30.0), view("t1", 15, 30), view("t2", 15, 30)]
    assert [m.to_node for m in plan_spread(slow, sessions, live=LIVE, now=10.0)] == ["t2", "t2"]
    full = {**LIVE, "h2": 0, "t2": 0}
    assert plan_spread(VIEWS, sessions, live=full, now=10.0) == []
    # t1 is not routable (lost, or quarantined): the sessions through it are a restart's, not a move's
    no_t1 = {k: v for k, v in LIVE.items() if k != "t1"}
    assert plan_spread(VIEWS, sessions, live=no_t1, now=10.0) == []
    # only one replica of a range is live: nowhere to move to
    no_h2 = {k: v for k, v in LIVE.items() if k != "h2"}
    assert [m.from_node for m in plan_spread(VIEWS, sessions, live=no_h2, now=10.0)] == ["t1", "t1"]


def test_plan_spread_leaves_what_routing_chose_between_replicas_of_unequal_speed() -> None:
    """h1 decodes 1.6x as fast as h2: routing puts about 5 of 7 sessions on it, and the plan
    leaves that (moving one would cost more there); 7 on h1 and 0 on h2 it evens out to it."""
    fast = [view("h1", 0, 15, tps=160.0), view("h2", 0, 15, tps=100.0), view("t1", 15, 30), view("t2", 15, 30)]
    split = [SpreadSession(f"r{i}", float(i), (head, ("t1", "t2")[i % 2]))
             for i, head in enumerate(["h1"] * 5 + ["h2"] * 2)]  # tails 4 / 3
    assert plan_spread(fast, split, live=LIVE, now=10.0) == []
    moves = plan_spread(fast, sessions_on("h1", "t1", 7, first_opened=-10.0), live=LIVE, now=10.0)
    assert [m.to_node for m in moves if m.range_key[2] == 0] == ["h2", "h2"]  # 7 / 0 to 5 / 2


def test_plan_spread_leaves_sessions_on_the_near_replica_until_its_load_costs_more_than_the_trip() -> None:
    """t2 is 100 ms from the heads (t1 1 ms): routing put every session on t1, and a move to t2
    would add the seam's round trip (one way in, one way back to the head) to each token; only
    when t1's sessions cost more than that trip does one go. The same for a head far from the
    gateway that asked for the route, whose round trips a request pays once per prefill frame
    and Decode Run (tracker/routing.py, `gateway_seconds`): a move to a head 6 s away would
    cost each token 6 s × 2 / 256 = 47 ms, more than 6 sessions against 0 save (38 ms)."""
    def far(node_id: str, start: int, end: int, tps: float = 100.0) -> NodeView:
        return replace(view(node_id, start, end, tps), peer_rtt_ms={"t1": 1.0, "t2": 100.0})

    views = [far("h1", 0, 15), far("h2", 0, 15), view("t1", 15, 30), view("t2", 15, 30)]
    sessions = [SpreadSession(f"r{i}", float(i), ("h1" if i % 2 else "h2", "t1")) for i in range(6)]
    assert plan_spread(views, sessions, live=LIVE, now=10.0) == []
    near = [replace(view("h1", 0, 15), peer_rtt_ms={"t1": 1.0, "t2": 2.0}),
            replace(view("h2", 0, 15), peer_rtt_ms={"t1": 1.0, "t2": 2.0}), *VIEWS[2:]]
    assert [m.to_node for m in plan_spread(near, sessions, live=LIVE, now=10.0)] == ["t2", "t2", "t2"]
    slow = [far("h1", 0, 15, 10.0), far("h2", 0, 15, 10.0), view("t1", 15, 30, 10.0), view("t2", 15, 30, 10.0)]
    assert [m.to_node for m in plan_spread(slow, sessions, live=LIVE, now=10.0)] == ["t2", "t2"]  # 0.1 s a token
    gateway = {"h1": 1.0, "h2": 6000.0}
    on_h1 = [SpreadSession(f"g{i}", float(i), ("h1", ("t1", "t2")[i % 2]), gateway) for i in range(6)]
    assert plan_spread(VIEWS, on_h1, live=LIVE, now=10.0) == []
    assert [m.to_node for m in plan_spread(VIEWS, [SpreadSession(s.route_id, s.opened_at, s.nodes) for s in on_h1],
                                           live=LIVE, now=10.0)] == ["h2", "h2", "h2"]


def test_a_head_that_measured_nothing_yet_does_not_draw_moves_by_its_seams_counting_0() -> None:
    """t1 is 100 ms from h1; h2 just joined (its first report names no round trip) and decodes
    at 60 tok/s. Priced with h1's round trips, 2 sessions against 0 do not pay a move to the
    slower h2; counted 0, its seams drew both."""
    views = [replace(view("h1", 0, 15), peer_rtt_ms={"t1": 100.0}), view("h2", 0, 15, tps=60.0),
             view("t1", 15, 30)]
    live = {"h1": 8, "h2": 8, "t1": 8}
    assert plan_spread(views, sessions_on("h1", "t1", 2, first_opened=-10.0), live=live, now=10.0) == []


def test_a_trip_both_replicas_share_does_not_raise_the_bar() -> None:
    """Both heads 100 ms from the gateway, both tails 100 ms from both heads: the sessions even
    out as they do at RTT 0 (the margin is on the replicas' own cost, not on the trips)."""
    far = {"t1": 100.0, "t2": 100.0}
    views = [replace(view("h1", 0, 15), peer_rtt_ms=far), replace(view("h2", 0, 15), peer_rtt_ms=far), *VIEWS[2:]]
    gateway = {"h1": 100.0, "h2": 100.0}
    sessions = [SpreadSession(f"r{i}", float(i), ("h1", ("t1", "t2")[i % 2]), gateway) for i in range(4)]
    near = [SpreadSession(s.route_id, s.opened_at, s.nodes) for s in sessions]
    assert moved(plan_spread(views, sessions, live=LIVE, now=10.0)) == moved(plan_spread(VIEWS, near, live=LIVE, now=10.0))
    assert [m.to_node for m in plan_spread(views, sessions, live=LIVE, now=10.0)] == ["h2", "h2"]  # 4 / 0 to 2 / 2


def test_plan_spread_evens_three_replicas() -> None:
    views = [*VIEWS, view("h3", 0, 15)]
    live = {**LIVE, "h3": 8}
    sessions = sessions_on("h1", "t1", 6) + sessions_on("h2", "t2", 6, prefix="s")
    moves = plan_spread(views, sessions, live=live, now=100.0, config=SpreadConfig(gap=2))
    heads = [m for m in moves if m.range_key[2] == 0]
    assert sorted(m.to_node for m in heads) == ["h3", "h3", "h3", "h3"]
    assert {m.from_node for m in heads} == {"h1", "h2"}


# -- a real move ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with restart_mesh(model_path, tmp_path_factory.mktemp("spread-mesh"), NODES) as m:
        # one session is enough to move: a gap of 1, at once, whatever it costs (the defaults
        # wait for a gap of 2, 1 s, and a move that routing's cost says is cheaper), onto an
        # idle replica whatever speed it measured at its start (with another node loading
        # beside it, a replica can measure itself at under half the speed of the decoding one,
        # a straggler the plan never moves onto); this module tests what a move does, the plan
        # is tested above
        m.tracker.placement.spread = SpreadConfig(gap=1, min_age_s=0.0, quiet_s=0.0, cooldown_s=0.0, margin=-1.0,
                                                  straggler_ratio=0.0)
        yield m


async def order_move_after(mesh: Mesh, http: aiohttp.ClientSession, sid: str, tokens: int,
                           headers: dict[str, str] | None = None) -> tuple[dict[str, object], list[RouteDirective]]:
    """Stream STORY as `sid`; once `tokens` arrived, let the tracker plan a spread round (the
    only session is 1 ahead on each range). The stream's result and the moves ordered."""
    # the in-process tracker stood still while the test loaded llama.cpp: it orders nothing
    # until every node was heard from since (rewarming)
    await asyncio.sleep(max(0.0, 2 * mesh.tracker.config.heartbeat_interval - mesh.tracker.clock.since_wake()) + 0.1)
    assert not mesh.tracker.nodes.rewarming()
    arrivals: list[float] = []
    task = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, MAX_TOKENS, arrivals, sid=sid, headers=headers))
    await route_nodes(http, mesh.url, sid)
    async with asyncio.timeout(120):
        while len(arrivals) < tokens:
            assert not task.done(), task.result()
            await asyncio.sleep(0.005)
    # a pause of the tracker's loop (a loaded machine) makes it rewarm for two heartbeats, when
    # it orders nothing: plan again until it orders, while the stream still runs
    orders = await mesh.tracker.placement.spread_tick()
    while not orders and not task.done():
        await asyncio.sleep(0.05)
        orders = await mesh.tracker.placement.spread_tick()
    async with asyncio.timeout(300):
        return await task, orders


@pytest.mark.asyncio(loop_scope="module")
async def test_a_moved_session_goes_on_exactly_and_the_node_it_left_frees_it(
        mesh: Mesh, reference: Reference) -> None:
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)  # off the mesh's loop
    async with aiohttp.ClientSession() as http:
        kept_before = sum((await gateway_counter(http, mesh.url, "meshnet_gateway_restart_kept_hops_total")).values())
        out, orders = await order_move_after(mesh, http, "spread-move", 20)
        assert out["error"] is None, out
        assert out["text"] == text  # one uninterrupted answer: nothing repeated, nothing missing
        assert len(orders) == 1 and orders[0].action == "move", orders
        left = orders[0].lost_node_id  # the head or the tail: both ranges are 1 to 0
        hops = [h.node_id for h in orders[0].session.hops]
        assert left in hops
        stays = 1 - hops.index(left)
        events = await session_events(http, mesh.url, "spread-move")
        moving = [e for e in events if e["phase"] == "restarting"]
        assert moving and moving[0]["moves"] == 1 and moving[0]["restarts"] == 0, moving
        assert moving[0]["lost_node_id"] == left and "moved off" in moving[0]["restart_reason"]
        final = events[-1]
        assert final["phase"] == "completed" and final["moves"] == 1 and final["restarts"] == 0, final
        assert left not in final["route_nodes"] and final["route_nodes"][stays] == hops[stays]
        moves = await gateway_counter(http, mesh.url, "meshnet_gateway_session_moves_total")
        assert moves.get("resumed") == 1.0, moves
        kept = sum((await gateway_counter(http, mesh.url, "meshnet_gateway_restart_kept_hops_total")).values())
        assert kept == kept_before + 1  # the hop it stayed on continued its Hot KV State
        # the node it left holds nothing of it: freed at once, not parked for a restart
        async with http.get(f"{node_url(mesh, left)}/v1/sessions") as resp:
            body = await resp.json()
        assert body["cache_bytes"] == 0 and not body["parked_sessions"], body
        # and it stays routable: a move is no loss
        assert left not in mesh.tracker.book.suspects and left in mesh.tracker.book.live


@pytest.mark.asyncio(loop_scope="module")
async def test_a_session_with_restarts_off_declines_a_move_and_keeps_its_route(
        mesh: Mesh, reference: Reference) -> None:
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)  # off the mesh's loop
    async with aiohttp.ClientSession() as http:
        declined = (await gateway_counter(http, mesh.url, "meshnet_gateway_session_moves_total")).get("declined", 0.0)
        out, orders = await order_move_after(mesh, http, "spread-off", 20, headers={"x-meshnet-restart": "off"})
        assert out["error"] is None and out["text"] == text, out
        assert len(orders) == 1
        events = await session_events(http, mesh.url, "spread-off")
        assert not [e for e in events if e["phase"] == "restarting"]
        assert events[-1]["moves"] == 0 and events[-1]["route_nodes"] == [h.node_id for h in orders[0].session.hops]
        moves = await gateway_counter(http, mesh.url, "meshnet_gateway_session_moves_total")
        assert moves.get("declined", 0.0) == declined + 1, moves


@pytest.mark.asyncio(loop_scope="module")
async def test_nothing_is_left_held_after_moves(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(60):
            while True:
                held = 0
                for node_id in NODES:
                    async with http.get(f"{node_url(mesh, node_id)}/v1/sessions") as resp:
                        body = await resp.json()
                    held += body["cache_bytes"] + body["parked_sessions"]
                if held == 0:
                    break
                await asyncio.sleep(0.5)
