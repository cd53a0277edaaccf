"""Registry, Coverage Map and rebalance planning: pure state, time passed in."""

from __future__ import annotations

import pytest

from schemas.capability import CapabilityReport, ShardRange
from schemas.coverage import chains_exactly, furthest_boundary
from schemas.node import NodeAnnouncement, NodeHeartbeat
from tracker.awake import AwakeClock, pause_in
from tracker.coverage import coverage_maps
from tracker.rebalance import plan_rebalance
from tracker.registry import Registry, RegistryConfig
from tracker.views import NodeView, free_slots, node_view, unheld_sessions


def ann(node_id: str, start: int = 0, end: int = 30, *, url: str = "http://h:1", spare: bool = False,
        started_at: float = 1.0, process_id: str = "") -> NodeAnnouncement:
    cap = CapabilityReport(
        model_arch="llama", model_name="smol", model_revision="rev1", runtime="llama.cpp",
        layers=ShardRange(start=start, end=end, n_layer=30), hidden_size=576, vocab_size=49152,
        n_ctx=4096, cache_abi="abi", cache_bytes_per_token=1, decode_tokens_per_second=50.0,
        max_sessions=4,
    )  # fmt: skip
    return NodeAnnouncement(node_id=node_id, activation_url=url, capability=cap, started_at=started_at, spare=spare,
                            process_id=process_id)


def test_siblings_are_the_nodes_one_process_on_one_host_serves() -> None:
    """A composite node's shards share their process's fate; a node that names another host's
    process id, or names none, has no siblings."""
    reg = Registry()
    for node_id, url, process in (("head-a", "http://h:1", "aa"), ("tail-a", "http://h:2", "aa"),
                                  ("head-b", "http://h:3", "bb"), ("tail-b", "http://h:4", "bb"),
                                  ("liar", "http://elsewhere:1", "aa"), ("plain", "http://h:5", ""),
                                  ("plain-2", "http://h:6", "")):
        reg.announce(ann(node_id, url=url, process_id=process), now=0.0)
    assert reg.siblings("head-a") == ["tail-a"] and reg.siblings("tail-b") == ["head-b"]
    assert reg.siblings("liar") == [] and reg.siblings("plain") == [] and reg.siblings("gone") == []


def test_a_leaving_node_is_removed_only_by_its_own_process() -> None:
    """A node shutting down leaves the registry at once; a leaving message of another process
    with its id (an older duplicate) removes nothing."""
    reg = Registry(RegistryConfig(heartbeat_interval=1.0, expire_after=3.0))
    reg.announce(ann("a", url="http://h:2", started_at=2.0), now=0.0)
    version = reg.version
    assert reg.leave("a", 1.0) is None and "a" in reg
    state = reg.leave("a", 2.0)
    assert state is not None and state.node_id == "a" and "a" not in reg and reg.version > version
    assert reg.leave("a", 2.0) is None  # gone already: nothing to remove


def test_a_second_live_process_with_the_same_id_neither_takes_it_over_nor_keeps_it_alive() -> None:
    """Two processes started with one --node-id: the newer keeps the id (a restart never starts
    in the past); the older's announcements are refused and its heartbeats keep nothing alive,
    so when the newer dies the id expires and the older one registers as new."""
    reg = Registry(RegistryConfig(heartbeat_interval=1.0, expire_after=3.0))
    assert reg.announce(ann("a", url="http://h:2", started_at=2.0), now=0.0) == "new"
    assert reg.announce(ann("a", url="http://h:1", started_at=1.0), now=0.5) == "refused"
    state = reg.get("a")
    assert state is not None and state.announcement.activation_url == "http://h:2"
    assert not reg.heartbeat(NodeHeartbeat(node_id="a", started_at=1.0), now=2.5)
    assert reg.older_process("a", 1.0) and not reg.older_process("a", 2.0) and not reg.older_process("a", 0.0)
    assert reg.heartbeat(NodeHeartbeat(node_id="a", started_at=2.0), now=2.0)
    assert reg.heartbeat(NodeHeartbeat(node_id="a"), now=2.0)  # (a sender that does not say: as before)
    assert [s.node_id for s in reg.expire(now=5.5)] == ["a"]  # the newer stopped: only the older beat since
    assert reg.announce(ann("a", url="http://h:1", started_at=1.0), now=5.6) == "new"
    assert reg.announce(ann("a", url="http://h:3", started_at=9.0), now=6.0) == "changed"  # a restart takes over


def test_registry_announce_heartbeat_expire() -> None:
    reg = Registry(RegistryConfig(heartbeat_interval=1.0, expire_after=3.0))
    assert reg.announce(ann("a"), now=0.0) == "new"
    assert reg.announce(ann("a"), now=0.5) == "refreshed"
    v = reg.version
    assert reg.announce(ann("a", url="http://h:2"), now=0.6) == "changed"
    assert reg.version == v + 1
    assert reg.announce(ann("b"), now=0.0) == "new"
    assert reg.heartbeat(NodeHeartbeat(node_id="a", sessions=1), now=2.9)
    assert not reg.heartbeat(NodeHeartbeat(node_id="ghost"), now=2.9)  # must announce first
    assert reg.expire(now=3.0) == []  # b: exactly 3 s is not yet "more than" 3 s
    gone = reg.expire(now=3.01)
    assert [s.node_id for s in gone] == ["b"]
    assert "b" not in reg and "a" in reg
    assert [s.node_id for s in reg.expire(now=5.85)] == []
    assert [s.node_id for s in reg.expire(now=5.95)] == ["a"]
    assert len(reg) == 0


def test_excused_silence_counts_from_the_trackers_reconnect() -> None:
    reg = Registry(RegistryConfig(heartbeat_interval=1.0, expire_after=3.0))
    reg.announce(ann("a"), now=0.0)
    reg.announce(ann("b"), now=9.0)
    reg.excuse(until=8.0)  # the tracker's bus was down until 8.0: nobody could be heard before
    assert reg.expire(now=10.5) == []  # a: 2.5 s since the reconnect, not 10.5 s of silence
    assert [s.node_id for s in reg.expire(now=11.01)] == ["a"]  # b was heard after it: its own time
    assert [s.node_id for s in reg.expire(now=12.01)] == ["b"]


@pytest.mark.parametrize(
    ("held", "opened", "ended"),
    [
        ([], [("s1", 0.0)], ["s1"]),  # opened long ago, the hop holds nothing: ended there
        (["s1"], [("s1", 0.0)], []),
        (["s1"], [("s1", 0.0), ("s2", 0.0), ("s3", 9.0)], ["s2"]),  # s3 is within the grace
        (["s9"], [("s2", 0.0), ("s1", 4.9)], ["s1", "s2"]),  # sorted; exactly the grace is past it
        ([], [], []),
    ],
)
def test_sessions_a_hop_no_longer_holds(held: list[str], opened: list[tuple[str, float]], ended: list[str]) -> None:
    assert unheld_sessions(held, opened, now=10.0, grace=5.0) == ended


@pytest.mark.parametrize(
    ("max_sessions", "open_routes", "free"),
    [(4, 0, 4), (4, 1, 3), (4, 4, 0), (4, 5, 0), (32, 31, 1), (1, 0, 1)],
)
def test_free_slots_is_max_sessions_minus_the_trackers_open_routes(
    max_sessions: int, open_routes: int, free: int
) -> None:
    assert free_slots(max_sessions, open_routes) == free


def test_node_view_free_slots_ignore_the_heartbeats_lagging_count() -> None:
    reg = Registry()
    reg.announce(ann("a"), now=0.0)
    state = reg.get("a")
    assert state is not None
    assert node_view(state, active_sessions=1).free_slots == 3  # no heartbeat yet
    assert not node_view(state).speed_served  # the speed is the load-time self-measurement
    # the heartbeat still counts a session the tracker already saw closed: the tracker's count wins
    reg.heartbeat(NodeHeartbeat(node_id="a", free_session_slots=2, decode_tokens_per_second=80.0), now=1)
    view = node_view(state, active_sessions=1)
    assert view.free_slots == 3 and view.decode_tps == 80.0 and view.speed_served
    reg.heartbeat(NodeHeartbeat(node_id="a", free_session_slots=4), now=2)
    assert node_view(state, active_sessions=4).free_slots == 0


def test_node_view_carries_the_active_bytes_routing_prices_unmeasured_hops_by() -> None:
    a = ann("a")
    moe = a.model_copy(update={"capability": a.capability.model_copy(update={"active_param_bytes_per_token": 7})})
    reg = Registry()
    reg.announce(moe, now=0.0)
    reg.announce(ann("old"), now=0.0)  # an announcement without the field
    assert node_view(reg.get("a")).active_bytes == 7  # type: ignore[arg-type]
    assert node_view(reg.get("old")).active_bytes == 0  # type: ignore[arg-type]


def v(node_id: str, start: int, end: int, *, rev: str = "r", spare: bool = False, sessions: int = 0) -> NodeView:
    return NodeView(
        node_id=node_id, activation_url="", model="smol", model_revision=rev, cache_abi="abi",
        start=start, end=end, n_layer=30, spare=spare, sessions=sessions,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("shards", "target", "status", "gaps", "thin", "routable"),
    [
        ([(0, 30)], 1, "covered", (), (), True),
        ([(0, 15), (15, 30)], 2, "under_provisioned", (), ((0, 30),), True),
        ([(0, 15), (0, 15), (15, 30)], 2, "under_provisioned", (), ((15, 30),), True),
        ([(0, 10), (20, 30)], 1, "gap", ((10, 20),), (), False),
        ([(0, 16), (15, 30)], 1, "covered", (), (), False),  # covered, but no exact chain
        ([(5, 30)], 1, "gap", ((0, 5),), (), False),
    ],
)
def test_coverage_map(shards, target, status, gaps, thin, routable) -> None:  # type: ignore[no-untyped-def]
    [cov] = coverage_maps([v(f"n{i}", s, e) for i, (s, e) in enumerate(shards)], target)
    assert cov.status == status
    assert cov.gaps == gaps
    assert cov.under_provisioned == thin
    assert cov.routable is routable


def test_coverage_is_per_revision() -> None:
    maps = coverage_maps([v("a", 0, 15, rev="r1"), v("b", 15, 30, rev="r2")], 1)
    assert [(m.model_revision, m.gaps) for m in maps] == [("r1", ((15, 30),)), ("r2", ((0, 15),))]


def test_chaining_helpers() -> None:
    assert chains_exactly([(0, 10), (10, 30)], 30)
    assert not chains_exactly([(0, 11), (10, 30)], 30)
    assert furthest_boundary([(0, 11), (10, 30), (0, 4)], 30) == 11


def test_rebalance_prefers_spares_then_redundant_nodes() -> None:
    views = [v("h1", 0, 15), v("h2", 0, 15), v("h3", 0, 15, sessions=2), v("t1", 15, 30)]
    maps = coverage_maps(views, 2)
    [order] = plan_rebalance(views, maps)
    assert (order.node_id, order.need.start, order.need.end) == ("h1", 15, 30)
    assert plan_rebalance(views, maps, pending={order.need.key}) == []
    assert plan_rebalance(views, maps, busy_nodes={"h1", "h2", "h3"}) == []

    spare = [*views, v("s9", 0, 15, spare=True)]
    [order] = plan_rebalance(spare, coverage_maps(spare, 2))
    assert order.node_id == "s9"


def test_rebalance_fills_a_gap_and_never_strips_a_thin_range() -> None:
    views = [v("h1", 0, 10), v("t1", 20, 30)]
    assert plan_rebalance(views, coverage_maps(views, 1)) == []  # nobody to spare
    views.append(v("t2", 20, 30))
    [order] = plan_rebalance(views, coverage_maps(views, 1))
    assert (order.node_id, order.need.start, order.need.end) == ("t1", 10, 20)
    assert "gap" in order.need.reason


def test_a_gap_in_the_watched_clock_longer_than_the_margin_is_a_pause() -> None:
    assert pause_in(0.1, 0.1) == 0.0
    assert pause_in(0.55, 0.1) == 0.0  # scheduling noise
    assert pause_in(3.1, 0.1) == pytest.approx(3.0)  # heartbeats of those 3 s may still wait unread


def test_the_awake_clock_leaves_out_the_trackers_own_pauses() -> None:
    base = [100.0]
    clock = AwakeClock(lambda: base[0], watch_s=0.1)
    base[0] = 105.0
    assert clock() == 105.0  # not watched yet: nothing is a pause
    clock._read_at = base[0]  # what watch() does when it starts
    for _ in range(10):  # watched every 0.1 s: awake time runs with the base clock
        base[0] += 0.1
        clock()
    assert clock() == pytest.approx(106.0) and clock.since_wake() == float("inf")
    base[0] += 6.1  # SIGSTOP for 6 s: the next reading, whoever makes it, sees the gap
    assert clock() == pytest.approx(106.1)
    assert clock.paused_s == pytest.approx(6.0) and clock.since_wake() == pytest.approx(0.0)
    base[0] += 0.1
    assert clock() == pytest.approx(106.2) and clock.since_wake() == pytest.approx(0.1)
    reg = Registry(RegistryConfig(1.0, 3.0))  # a node last heard just before the pause is not expired by it
    reg.announce(ann("n1", 0, 30), 106.0)
    assert reg.expire(clock()) == []


def test_rebalance_orders_idle_spares_first_and_skips_refusals() -> None:
    from tracker.views import SpareView

    views = [v("h1", 0, 15), v("h2", 0, 15, spare=True)]
    spares = [SpareView("sp-b", "a" * 32, "smol", "r", "abi", 30), SpareView("sp-a", "a" * 32, "smol", "r", "abi", 30),
              SpareView("other", "b" * 32, "smol", "rev2", "abi", 30)]
    maps = coverage_maps(views, 1)
    [order] = plan_rebalance(views, maps, spares=spares)
    assert (order.node_id, order.artifact_id, order.need.start, order.need.end) == ("sp-a", "a" * 32, 15, 30)
    [order] = plan_rebalance(views, maps, spares=spares, refused={("sp-a", order.need.key)})
    assert order.node_id == "sp-b"  # the next spare, at once
    refused = {(n, order.need.key) for n in ("sp-a", "sp-b")}
    [order] = plan_rebalance(views, maps, spares=spares, refused=refused)
    assert order.node_id == "h2"  # then a serving node that said it acts on orders


def test_a_model_only_spares_offer_is_one_gap() -> None:
    [cov] = coverage_maps([], 1, offered=[("smol", "rev", "abi", 30)])
    assert (cov.status, cov.gaps, cov.routable) == ("gap", ((0, 30),), False)
    assert [m.status for m in coverage_maps([v("h1", 0, 30)], 1, offered=[("smol", "r", "abi", 30)])] == ["covered"]


def test_a_refused_second_process_opens_none_of_its_ids_routes() -> None:
    """Routes name the kept process's address, so the other process with that id opens nothing."""
    from nodes.server.presence import my_hops
    from schemas.route import Hop, RouteSession

    hops = [Hop(node_id="a", activation_url="http://h:2", layer_start=0, layer_end=15),
            Hop(node_id="b", activation_url="http://h:3", layer_start=15, layer_end=30)]
    session = RouteSession(session_id="s", route_id="r", model="m", model_revision="m", cache_abi="a",
                           n_layer=30, hidden_size=8, n_ctx=64, hops=hops)
    assert my_hops(session, "a", "http://h:2") == [0]
    assert my_hops(session, "a", "http://h:1") == []  # the refused process of id "a"
    assert my_hops(session, "c", "http://h:2") == []


def test_a_gap_no_spare_can_take_whole_is_cut_in_halves_for_two_spares() -> None:
    """Two neighbouring nodes lost: the gap [10,30) is more than either spare may hold (both
    refuse it whole), so its halves go one to each; it was ordered whole every cooldown, forever."""
    from tracker.views import SpareView

    views = [v("a", 0, 10)]
    spares = [SpareView(n, "a" * 32, "smol", "r", "abi", 30) for n in ("sp-x", "sp-y")]
    maps = coverage_maps(views, 1)
    [order] = plan_rebalance(views, maps, spares=spares)
    assert (order.node_id, order.need.start, order.need.end) == ("sp-x", 10, 30)
    whole = order.need.key
    [order] = plan_rebalance(views, maps, spares=spares, refused={("sp-x", whole)})
    assert (order.node_id, order.need.start, order.need.end) == ("sp-y", 10, 30)  # the whole, to the next first
    orders = plan_rebalance(views, maps, spares=spares, refused={("sp-x", whole), ("sp-y", whole)})
    assert [(o.node_id, o.need.start, o.need.end) for o in orders] == [("sp-x", 10, 20), ("sp-y", 20, 30)]
    assert all(o.need.gap and "no node could take it whole" in o.need.reason for o in orders)
    # one half pending (its spare fetching), the other refused by both too: that half is cut again
    half = orders[1].need.key
    orders = plan_rebalance(views, maps, spares=spares, busy_nodes={"sp-x"}, pending={orders[0].need.key},
                            refused={("sp-x", whole), ("sp-y", whole), ("sp-y", half), ("sp-x", half)})
    assert [(o.node_id, o.need.start, o.need.end) for o in orders] == [("sp-y", 20, 25)]
    # a single spare that cannot take the gap is not handed a fragment of it
    assert plan_rebalance(views, maps, spares=spares[:1], refused={("sp-x", whole)}) == []


def test_a_gap_whose_orders_failed_for_want_of_seeders_is_not_cut() -> None:
    from tracker.views import SpareView

    views = [v("a", 0, 10)]
    spares = [SpareView(n, "a" * 32, "smol", "r", "abi", 30) for n in ("sp-x", "sp-y")]
    maps = coverage_maps(views, 1)
    whole = plan_rebalance(views, maps, spares=spares)[0].need.key
    refused = {("sp-x", whole), ("sp-y", whole)}
    assert plan_rebalance(views, maps, spares=spares, refused=refused, too_large=set()) == []  # both `failed`
    assert len(plan_rebalance(views, maps, spares=spares, refused=refused, too_large=refused)) == 2


def test_a_refusal_names_the_nodes_left_out_as_siblings_of_an_excluded_one() -> None:
    """`meshnet up --replicas 2` runs each chain in one process: a validator replaying a session
    whose route crossed both processes asks for a route without its three nodes, the tracker
    leaves out their siblings too, and the refusal read "missing layers [0,30)" with every layer
    served. It now names the nodes left out as siblings; other refusals are unchanged."""
    from schemas.route import RouteError
    from tracker.route_handler import with_siblings_named

    err = RouteError(code="no_coverage", message="nodes of 'rev': missing layers [0,30)")
    named = with_siblings_named(err, frozenset({"node-2-1", "node-0-0"}))
    assert named.message.startswith(err.message)
    assert "also left out: node-0-0, node-2-1, served by the same processes" in named.message
    assert with_siblings_named(err, frozenset()) == err
    other = RouteError(code="bad_request", message="x")
    assert with_siblings_named(other, frozenset({"a"})) == other
