"""Route selection as a table: pure functions over plain NodeViews."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from schemas.route import RouteError, RoutePolicy, RouteRequest, RouteSession
from tracker.routing import RouteQuery, build_index, plan_route, select_route
from tracker.views import NodeView

N = 30


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
) -> NodeView:
    return NodeView(
        node_id=node_id, activation_url=f"http://127.0.0.1/{node_id}", model=model,
        model_revision=rev, cache_abi=abi, start=start, end=end, n_layer=N, hidden_size=576,
        n_ctx=n_ctx, decode_tps=tps, free_slots=free, max_sessions=4, load=load,
    )  # fmt: skip


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
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_route_selection(case: Case) -> None:
    index = build_index(case.nodes)
    policy = RoutePolicy(kind="private", allow_nodes=case.allow) if case.allow is not None else RoutePolicy()
    req = RouteRequest(model=case.model, policy=policy, prompt_tokens=case.prompt_tokens)
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
