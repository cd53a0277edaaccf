"""Route selection as a table: pure functions over plain NodeViews."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from schemas.node import MAX_RTT_MS
from schemas.route import RouteError, RoutePolicy, RouteRequest, RouteSession
from tracker.routing import (
    DEFAULT_CONFIG,
    ByteRates,
    RouteQuery,
    build_index,
    byte_rates,
    gateway_seconds,
    hop_cost,
    plan_route,
    seam_seconds,
    select_route,
    sender_rtts,
    token_seconds,
)
from tracker.views import NodeView

N = 30
MB = 1_000_000


def node(
    node_id: str,
    start: int,
    end: int,
    *,
    tps: float = 100.0,
    rev: str = "rev1",
    abi: str = "llama.cpp/f16",
    free: int = 4,
    n_ctx: int = 4096,
    load: float = 0.0,
    model: str = "smol",
    prefill: float = 0.0,
    active: int = 0,
    rtt: dict[str, float] | None = None,
    served: bool = True,
) -> NodeView:
    return NodeView(
        node_id=node_id, activation_url=f"http://127.0.0.1/{node_id}", model=model,
        model_revision=rev, cache_abi=abi, start=start, end=end, n_layer=N, hidden_size=576,
        n_ctx=n_ctx, decode_tps=tps, prefill_tps=prefill, free_slots=free, max_sessions=4, load=load,
        active_bytes=active, peer_rtt_ms=rtt or {}, speed_served=served,
    )  # fmt: skip


def moe_active(start: int, end: int) -> int:
    """Active bytes per token of [start, end) of a model whose layers 0-9 are dense (1 MB a
    token) and 10-29 MoE (3 MB: the router, the shared tensors, 2 of its experts)."""
    return sum(1 * MB if layer < 10 else 3 * MB for layer in range(start, end))


def unmeasured(node_id: str, start: int, end: int, **kw: object) -> NodeView:
    """A node that has not measured its speed yet: it reports only its active bytes."""
    return node(node_id, start, end, tps=0.0, active=moe_active(start, end), **kw)  # type: ignore[arg-type]


@dataclass
class Case:
    name: str
    nodes: list[NodeView]
    route: list[str] | None = None  # expected hop node ids
    error: str | None = None  # expected RouteError code
    missing: list[tuple[int, int]] = field(default_factory=list)
    model: str = "smol"
    allow: list[str] | None = None  # private policy allow list
    live: dict[str, int] | None = None
    prompt_tokens: int = 0
    head_rtt: dict[str, float] = field(default_factory=dict)  # the gateway's round trips to heads


CASES = [
    Case("single full node", [node("a", 0, 30)], route=["a"]),
    Case("two halves chain", [node("h", 0, 15), node("t", 15, 30)], route=["h", "t"]),
    Case(
        "gap between shards",
        [node("h", 0, 10), node("t", 15, 30)],
        error="no_coverage",
        missing=[(10, 15)],
    ),
    Case("tail missing", [node("h", 0, 15)], error="no_coverage", missing=[(15, 30)]),
    Case(
        "overlap that never meets exactly is not a route",
        [node("h", 0, 16), node("t", 15, 30)],
        error="no_coverage",
        missing=[(16, 30)],
    ),
    Case(
        "overlap: only the chain that meets exactly",
        [node("h", 0, 16), node("h2", 0, 10), node("m", 10, 15), node("t", 15, 30)],
        route=["h2", "m", "t"],
    ),
    Case(
        "fewer hops win at equal speed",
        [node("a", 0, 30), node("h", 0, 15), node("t", 15, 30)],
        route=["a"],
    ),
    Case(
        "faster pair beats slow full node",
        [node("a", 0, 30, tps=20.0), node("h", 0, 15, tps=300), node("t", 15, 30, tps=300)],
        route=["h", "t"],
    ),
    Case(
        # t1 is idle so it would be cheapest by cost, but it runs < 0.5x the median of its peers
        "straggler excluded when a peer serves the same range",
        [
            node("h", 0, 15),
            node("t1", 15, 30, tps=40),
            node("t2", 15, 30, tps=100, load=0.8),
            node("t3", 15, 30, tps=110, load=0.8),
        ],
        route=["h", "t3"],
    ),
    Case(
        # the same, but t1's speed is only its self-measurement at load (maybe beside another
        # process's work): it ranks t1, and t1, the cheapest, gets the route to measure itself
        "a speed measured only at load makes no straggler",
        [
            node("h", 0, 15),
            node("t1", 15, 30, tps=40, served=False),
            node("t2", 15, 30, tps=100, load=0.8),
            node("t3", 15, 30, tps=110, load=0.8),
        ],
        route=["h", "t1"],
    ),
    Case(
        "straggler used when it is the only way",
        [node("h", 0, 15), node("t1", 15, 30, tps=10), node("t2", 15, 30, tps=100), node("t3", 15, 30, tps=100)],
        live={"h": 1, "t1": 1, "t2": 0, "t3": 0},
        route=["h", "t1"],
    ),
    Case(
        "cache ABI mismatch is never mixed",
        [node("h", 0, 15, abi="llama.cpp/f16"), node("t", 15, 30, abi="torch/f32")],
        error="incompatible",
    ),
    Case(
        "model revision mismatch is never mixed",
        [node("h", 0, 15, rev="rev1"), node("t", 15, 30, rev="rev2")],
        error="incompatible",
    ),
    Case(
        "revision mismatch: the compatible group is chosen",
        [node("h", 0, 15, rev="rev1"), node("t", 15, 30, rev="rev2"), node("t1", 15, 30, rev="rev1")],
        route=["h", "t1"],
    ),
    Case(
        "request by revision",
        [node("a", 0, 30, rev="rev1"), node("b", 0, 30, rev="rev2", tps=500)],
        model="rev1",
        route=["a"],
    ),
    Case("unknown model", [node("a", 0, 30)], model="other", error="unknown_model"),
    Case(
        "private policy honoured",
        [node("fast", 0, 30, tps=900), node("h", 0, 15), node("t", 15, 30)],
        allow=["h", "t"],
        route=["h", "t"],
    ),
    Case(
        "private policy without coverage",
        [node("fast", 0, 30), node("h", 0, 15), node("t", 15, 30)],
        allow=["h"],
        error="no_coverage",
        missing=[(15, 30)],
    ),
    Case(
        "deterministic tie broken by node_id",
        [node("b", 0, 30), node("c", 0, 30), node("a", 0, 30)],
        route=["a"],
    ),
    Case(
        "no capacity: covered but every slot taken",
        [node("h", 0, 15, free=0), node("t", 15, 30)],
        error="no_capacity",
    ),
    Case(
        "no capacity: the live map says full",
        [node("a", 0, 30)],
        live={"a": 0},
        error="no_capacity",
    ),
    Case(
        "expired node (absent from live) is a gap",
        [node("h", 0, 15), node("t", 15, 30)],
        live={"h": 4},
        error="no_coverage",
        missing=[(15, 30)],
    ),
    Case(
        "prompt longer than a node's context",
        [node("a", 0, 30, n_ctx=512), node("b", 0, 30, n_ctx=8192, tps=50)],
        prompt_tokens=1000,
        route=["b"],
    ),
    Case(
        "replicas share the sessions: the one holding fewer of them wins",
        [node("a", 0, 30), node("b", 0, 30)],
        live={"a": 2, "b": 4},
        route=["b"],
    ),
    Case(
        "a much faster replica still takes a second session",
        [node("a", 0, 30, tps=300), node("b", 0, 30)],
        live={"a": 3, "b": 4},
        route=["a"],
    ),
    Case(
        "sessions count per hop: each half goes to its emptier replica",
        [node("h1", 0, 15), node("h2", 0, 15), node("t1", 15, 30), node("t2", 15, 30)],
        live={"h1": 3, "h2": 4, "t1": 4, "t2": 2},
        route=["h2", "t1"],
    ),
    Case(
        "busy node avoided",
        [node("a", 0, 30, load=0.9), node("b", 0, 30, load=0.1)],
        route=["b"],
    ),
    # cost model: nobody measured, so hops cost their active bytes (not their layer count)
    Case(
        # each route holds one half-busy 20-layer node: a2 serves the MoE-heavy [10,30) (60 MB a
        # token), x1 [0,20) (40 MB). By layer or hop count the routes tie, and a1+a2 wins on node_id
        "unmeasured: the busy node goes where a token reads fewer bytes",
        [unmeasured("x1", 0, 20, load=0.5), unmeasured("x2", 20, 30),
         unmeasured("a1", 0, 10), unmeasured("a2", 10, 30, load=0.5)],
        route=["x1", "x2"],
    ),
    Case(
        # the same nodes, measured: a2 runs the MoE-heavy range at 400 tok/s, so its route wins
        "measured tok/s wins over the active-bytes estimate",
        [node("x1", 0, 20, load=0.5, active=moe_active(0, 20)), node("x2", 20, 30, active=moe_active(20, 30)),
         node("a1", 0, 10, active=moe_active(0, 10)), node("a2", 10, 30, tps=400, load=0.5,
                                                            active=moe_active(10, 30))],
        route=["a1", "a2"],
    ),
    Case(
        # w measured 100 tok/s for 70 MB a token: the unmeasured pair, pricing its 10 + 60 MB at
        # w's 7 GB/s, costs the same compute plus one more hop (at the config's default byte
        # rate it would have looked 1.8x faster than w)
        "unmeasured hops are priced on the scale of their group's measured ones",
        [node("w", 0, 30, active=moe_active(0, 30)), unmeasured("h", 0, 10), unmeasured("t", 10, 30)],
        route=["w"],
    ),
    Case(
        "an unmeasured node takes its range's measured median, not an estimate",
        [node("h", 0, 10, active=moe_active(0, 10)), unmeasured("t1", 10, 30),
         node("t2", 10, 30, tps=50, active=moe_active(10, 30), load=0.3)],
        route=["h", "t1"],  # t1 is priced at t2's 50 tok/s, and t2 is busy
    ),
    # cost model: a long prompt weighs each hop's prefill
    Case(
        "no prompt length: decode speed decides",
        [node("p", 0, 30, tps=200, prefill=100), node("q", 0, 30, tps=100, prefill=2000)],
        route=["p"],
    ),
    Case(
        "a short prompt: decode speed still decides",
        [node("p", 0, 30, tps=200, prefill=100), node("q", 0, 30, tps=100, prefill=2000)],
        prompt_tokens=16,
        route=["p"],
    ),
    Case(
        "a long prompt: the fast prefill wins",
        [node("p", 0, 30, tps=200, prefill=100), node("q", 0, 30, tps=100, prefill=2000)],
        prompt_tokens=2000,
        route=["q"],
    ),
    # the network: each seam adds the round trip its sender measured (seconds per token, like the hops)
    Case(
        "two tails alike but for the round trip from the head: the near one",
        [node("h", 0, 15, rtt={"t-far": 50.0, "t-near": 1.0}), node("t-far", 15, 30), node("t-near", 15, 30)],
        route=["h", "t-near"],
    ),
    Case(
        "a near tail beats a faster far one when the trip costs more than the speed saves",
        [node("h", 0, 15, rtt={"t-far": 50.0, "t-near": 1.0}), node("t-far", 15, 30, tps=250),
         node("t-near", 15, 30, tps=150)],
        route=["h", "t-near"],
    ),
    Case(
        "a fast far tail beats a slow near one when the speed saves more than the trip costs",
        [node("h", 0, 15, rtt={"t-far": 3.0, "t-near": 1.0}), node("t-far", 15, 30, tps=300),
         node("t-near", 15, 30, tps=160)],
        route=["h", "t-far"],
    ),
    Case(
        "the seam depends on the head chosen: the pair that is near each other wins",
        [node("h-a", 0, 15, rtt={"t-a": 1.0, "t-b": 80.0}), node("h-b", 0, 15, rtt={"t-a": 80.0, "t-b": 1.0}),
         node("t-a", 15, 30), node("t-b", 15, 30, tps=110)],
        route=["h-b", "t-b"],
    ),
    Case(
        "on 3 hops the tail's token goes straight back to the head: of two tails alike for the "
        "middle hop, the one near the head",
        [node("h", 0, 10, rtt={"m": 2.0, "t-a": 80.0, "t-b": 2.0}), node("m", 10, 20, rtt={"t-a": 2.0, "t-b": 2.0}),
         node("t-a", 20, 30), node("t-b", 20, 30)],
        route=["h", "m", "t-b"],
    ),
    Case(
        "a seam costs its one way (the token comes back from the tail): a middle hop 10 ms away "
        "costs 10 ms per token, less than a slow near one's 15 ms more compute",
        [node("h", 0, 10, rtt={"m-far": 10.0, "m-near": 1.0, "t": 2.0}), node("m-far", 10, 20, rtt={"t": 10.0}),
         node("m-near", 10, 20, rtt={"t": 1.0}, tps=40), node("t", 20, 30)],
        route=["h", "m-far", "t"],
    ),
    Case(
        "the gateway's round trip to each head counts",
        [node("h-a", 0, 15), node("h-b", 0, 15), node("t", 15, 30)],
        head_rtt={"h-a": 60.0, "h-b": 2.0},
        route=["h-b", "t"],
    ),
    Case(
        "a head far from the gateway but near its tail beats one near the gateway and far from "
        "the tail: the gateway's trip is paid per request (the head streams the tokens), the "
        "seam's by every token",
        [node("h-a", 0, 15, rtt={"t": 2.0}), node("h-b", 0, 15, rtt={"t": 100.0}), node("t", 15, 30)],
        head_rtt={"h-a": 200.0, "h-b": 2.0},
        route=["h-a", "t"],
    ),
    Case(
        "a head that just joined (it measured nothing yet) is priced with its replicas' round "
        "trips, not 0: a slower one does not win every route until its first report",
        [node("h-old", 0, 15, rtt={"t": 50.0}), node("h-new", 0, 15, tps=90), node("t", 15, 30)],
        route=["h-old", "t"],
    ),
    Case(
        "an unmeasured seam counts as the sender's average, between its near and far ones",
        [node("h", 0, 15, rtt={"t-far": 60.0, "t-near": 2.0}), node("t-far", 15, 30), node("t-new", 15, 30),
         node("t-near", 15, 30)],
        live={"h": 4, "t-far": 4, "t-new": 4},
        route=["h", "t-new"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_route_selection(case: Case) -> None:
    index = build_index(case.nodes)
    policy = RoutePolicy(kind="private", allow_nodes=case.allow) if case.allow is not None else RoutePolicy()
    req = RouteRequest(model=case.model, policy=policy, prompt_tokens=case.prompt_tokens, head_rtt_ms=case.head_rtt)
    got = select_route(index, req, session_id="s1", route_id="r1", live=case.live)
    if case.error is not None:
        assert isinstance(got, RouteError), got
        assert got.code == case.error, got.message
        if case.missing:
            assert got.missing_ranges == case.missing
        return
    assert isinstance(got, RouteSession), got
    assert [h.node_id for h in got.hops] == case.route
    assert got.hops[0].layer_start == 0 and got.hops[-1].layer_end == N
    for a, b in zip(got.hops, got.hops[1:], strict=False):
        assert a.layer_end == b.layer_start  # hops meet exactly
    assert {(h.node_id, h.layer_start, h.layer_end) for h in got.hops} <= {
        (v.node_id, v.start, v.end) for v in case.nodes
    }


def test_seam_seconds_of_measured_and_unmeasured_receivers() -> None:
    assert seam_seconds({"a": 20.0, "b": 40.0}, "a") == 0.02
    assert seam_seconds({"a": 20.0, "b": 40.0}, "c") == pytest.approx(0.03)  # the sender's average
    assert seam_seconds({}, "c") == 0.0
    unreachable = {"a": 20.0, "gone": MAX_RTT_MS}  # a peer its sender could not reach
    assert seam_seconds(unreachable, "gone") == MAX_RTT_MS / 1000
    assert seam_seconds(unreachable, "c") == pytest.approx(0.02)  # the unreached one is no average


def test_a_busy_near_tail_still_shares_with_a_far_one() -> None:
    """The round trip is one cost among others: sessions piling up on the near replica make
    the far one cheaper at some point (the same per-session weight as between any replicas)."""
    views = [node("h", 0, 15, rtt={"t-far": 20.0, "t-near": 1.0}, free=20), node("t-far", 15, 30),
             node("t-near", 15, 30)]
    index = build_index(views)
    near = plan_route(index, RouteQuery(model="smol"), live={"h": 4, "t-far": 4, "t-near": 4})
    busy = plan_route(index, RouteQuery(model="smol"), live={"h": 4, "t-far": 4, "t-near": 1})
    assert not isinstance(near, RouteError) and not isinstance(busy, RouteError)
    assert near.hops[1].node_id == "t-near" and busy.hops[1].node_id == "t-far"


def test_same_inputs_same_route_regardless_of_order() -> None:
    views = [node(f"n{i:02d}", s, e) for i, (s, e) in enumerate([(0, 10), (10, 20), (20, 30)] * 5)]
    first = plan_route(build_index(views), RouteQuery(model="smol"))
    again = plan_route(build_index(list(reversed(views))), RouteQuery(model="smol"))
    assert not isinstance(first, RouteError) and not isinstance(again, RouteError)
    assert [v.node_id for v in first.hops] == [v.node_id for v in again.hops] == ["n00", "n01", "n02"]


def test_session_fields_come_from_the_group() -> None:
    views = [node("h", 0, 15, n_ctx=2048), node("t", 15, 30, n_ctx=1024)]
    got = select_route(build_index(views), RouteRequest(model="smol"), session_id="s", route_id="r")
    assert isinstance(got, RouteSession)
    assert (got.model, got.model_revision, got.cache_abi, got.n_layer, got.hidden_size, got.n_ctx) == (
        "smol", "rev1", "llama.cpp/f16", 30, 576, 1024,
    )  # fmt: skip
    assert got.hops[1].activation_url == "http://127.0.0.1/t"


def test_a_restart_route_leaves_out_the_lost_hop_and_carries_its_epoch() -> None:
    views = [node("h1", 0, 15, tps=200), node("h2", 0, 15), node("t1", 15, 30, tps=200), node("t2", 15, 30)]
    index = build_index(views)
    first = select_route(index, RouteRequest(model="smol"), session_id="s", route_id="r1")
    assert isinstance(first, RouteSession) and [h.node_id for h in first.hops] == ["h1", "t1"]
    again = select_route(index, RouteRequest(model="smol", epoch=2, policy=RoutePolicy(exclude_nodes=["t1"])),
                         session_id="s-e2", route_id="r2")
    assert isinstance(again, RouteSession)
    assert [h.node_id for h in again.hops] == ["h1", "t2"] and again.epoch == 2
    none_left = select_route(index, RouteRequest(model="smol", policy=RoutePolicy(exclude_nodes=["t1", "t2"])),
                             session_id="s-e3", route_id="r3")
    assert isinstance(none_left, RouteError) and none_left.code == "no_coverage"
    assert none_left.missing_ranges == [(15, 30)]


@pytest.mark.parametrize(
    ("measured", "peers", "active", "rate", "seconds"),
    [
        (200.0, 50.0, 60 * MB, 6e9, 1 / 200),  # its own measurement first
        (0.0, 50.0, 60 * MB, 6e9, 1 / 50),  # then its range's measured peers
        (0.0, 0.0, 60 * MB, 6e9, 0.01),  # then its active bytes at the group's rate
        (0.0, 0.0, 20 * MB, 6e9, 0.01 / 3),  # a third of the bytes, a third of the time
        (0.0, 0.0, 0, 6e9, 1 / 100),  # an older node reporting no bytes: the default tok/s
    ],
)
def test_seconds_per_token_prefer_measurements_then_active_bytes(
    measured: float, peers: float, active: int, rate: float, seconds: float
) -> None:
    assert token_seconds(measured, peers, active, rate, 100.0) == pytest.approx(seconds)


def test_equal_layer_counts_cost_their_active_bytes_when_unmeasured() -> None:
    dense, moe = unmeasured("d", 0, 10), unmeasured("m", 10, 20)  # 10 layers each: 10 MB, 30 MB
    rates = ByteRates(decode=10e9, prefill=40e9)
    d, m = hop_cost(dense, 0.0, rates=rates), hop_cost(moe, 0.0, rates=rates)
    overhead = 0.001
    assert (d.cost - overhead, m.cost - overhead) == pytest.approx((0.001, 0.003))
    assert (d.prefill_cost, m.prefill_cost) == pytest.approx((0.00025, 0.00075))


def test_byte_rates_come_from_the_groups_measured_hops() -> None:
    views = [node("a", 0, 10, tps=100, prefill=1000, active=10 * MB), node("b", 10, 30, tps=50, active=60 * MB),
             unmeasured("c", 0, 10), node("old", 0, 30, tps=500)]  # old: no bytes, so no rate
    got = byte_rates(views)
    assert (got.decode, got.prefill) == (2e9, 10e9)  # median(1e9, 3e9); the one prefill figure
    default = byte_rates([unmeasured("c", 0, 10)])
    assert (default.decode, default.prefill) == (8.8e9, 20.3e9)


def test_the_gateways_trip_to_a_head_is_paid_per_prefill_frame_and_decode_run() -> None:
    """Once per prefill frame of the gateway's chunk (each answered before the next goes) and
    once for the Decode Run, spread over the tokens a request is expected to decode."""
    per = DEFAULT_CONFIG.decode_tokens_per_request
    assert gateway_seconds({"h": 100.0}, "h") == pytest.approx(0.1 * 2 / per)  # one frame, one run
    assert gateway_seconds({"h": 100.0}, "h", prompt_tokens=64) == pytest.approx(0.1 * 2 / per)
    assert gateway_seconds({"h": 100.0}, "h", prompt_tokens=65) == pytest.approx(0.1 * 3 / per)
    assert gateway_seconds({}, "h", prompt_tokens=500) == 0.0  # the gateway measured nothing yet


def test_a_sender_that_measured_nothing_takes_its_replicas_round_trips() -> None:
    new = node("new", 0, 15)
    replicas = [new, node("a", 0, 15, rtt={"t1": 20.0, "t2": 40.0}), node("b", 0, 15, rtt={"t1": 40.0, "t2": MAX_RTT_MS})]
    assert sender_rtts(new, replicas) == {"t1": 30.0, "t2": 40.0}  # a peer one could not reach: the others'
    assert sender_rtts(replicas[1], replicas) == {"t1": 20.0, "t2": 40.0}  # its own, once it measured
    assert sender_rtts(new, [new]) == {}  # nobody measured: every seam counts 0, alike


def test_the_way_back_to_the_head_counts_on_three_hops() -> None:
    """Two heads reach the one middle hop; h1 by a cheaper seam, but the tail's token goes back
    to the head straight (direct return), and h1 is far from the tail: the chain through h2
    wins (a DP that kept only the chain cheaper up to the middle hop chose h1)."""
    views = [node("h1", 0, 10, rtt={"m": 2.0, "t": 60.0}), node("h2", 0, 10, rtt={"m": 10.0, "t": 4.0}),
             node("m", 10, 20, rtt={"t": 2.0}), node("t", 20, 30)]
    got = plan_route(build_index(views), RouteQuery(model="smol"))
    assert not isinstance(got, RouteError) and [v.node_id for v in got.hops] == ["h2", "m", "t"]


def _chain_cost(chain: list[NodeView], cost: dict[str, float], views: list[NodeView]) -> float:
    """A chain's cost as the route cost defines it (hop costs, half of each seam's round trip,
    half the head's round trip to the tail; a sender that measured nothing priced with its
    range's replicas' round trips), by brute force."""
    total = sum(cost[v.node_id] for v in chain)
    total += sum(seam_seconds(_rtts(a, views), b.node_id) / 2 for a, b in pairwise(chain))
    return total + (seam_seconds(_rtts(chain[0], views), chain[-1].node_id) / 2 if len(chain) > 1 else 0.0)


def _rtts(v: NodeView, views: list[NodeView]) -> Mapping[str, float]:
    return sender_rtts(v, [r for r in views if (r.start, r.end) == (v.start, v.end)])


def _all_chains(views: list[NodeView], at: int = 0) -> list[list[NodeView]]:
    if at == N:
        return [[]]
    return [[v, *rest] for v in views if v.start == at for rest in _all_chains(views, v.end)]


@pytest.mark.parametrize("seed", range(12))
def test_the_route_is_the_cheapest_chain_on_any_number_of_hops(seed: int) -> None:
    """Random meshes of 2-4 hops, several replicas per range, random round trips (some
    unmeasured, some senders with none): the chosen route costs what the cheapest of all chains costs."""
    import random

    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, N), rng.randint(1, 3)))
    ranges = list(zip([0, *cuts], [*cuts, N], strict=True))
    ids = [f"n{i}-{r}" for i in range(len(ranges)) for r in range(rng.randint(1, 3))]
    views = []
    for node_id in ids:
        a, b = ranges[int(node_id[1:].split("-")[0])]
        rtt = {o: round(rng.uniform(0.5, 80.0), 1) for o in ids if o != node_id and rng.random() < 0.8}
        if rng.random() < 0.15:  # it just joined: it measured nothing yet
            rtt = {}
        views.append(node(node_id, a, b, tps=rng.choice([80.0, 100.0, 120.0]), rtt=rtt))
    got = plan_route(build_index(views), RouteQuery(model="smol"))
    assert not isinstance(got, RouteError)
    index = build_index(views)
    cost = {rn.view.node_id: rn.cost for g in index.groups.values() for bs in g.buckets.values()
            for bucket in bs for rn in bucket.ranked}
    cheapest = min(_chain_cost(c, cost, views) for c in _all_chains(views))
    assert _chain_cost(list(got.hops), cost, views) == pytest.approx(cheapest)


def test_a_route_holds_the_answer_too_not_only_the_prompt() -> None:
    """A user probe: a tail replica started with a smaller --ctx (256) beside two 2048 nodes. A
    200-token prompt with max_tokens 500 fits the 2048 chain, but the route went to the small
    tail (prompt_tokens 200 <= 256), whose context the answer would overrun. A route request
    now carries its prompt and answer's positions (`context_tokens`), and every hop holds them."""
    index = build_index([node("h", 0, 15, n_ctx=2048), node("t", 15, 30, n_ctx=2048),
                         node("small", 15, 30, n_ctx=256, tps=500.0)])
    req = RouteRequest(model="smol", prompt_tokens=200, context_tokens=700)
    got = select_route(index, req, session_id="s1", route_id="r1")
    assert isinstance(got, RouteSession) and [h.node_id for h in got.hops] == ["h", "t"], got
    short = RouteRequest(model="smol", prompt_tokens=200, context_tokens=240)
    got = select_route(index, short, session_id="s2", route_id="r2")
    assert isinstance(got, RouteSession) and [h.node_id for h in got.hops] == ["h", "small"], got
