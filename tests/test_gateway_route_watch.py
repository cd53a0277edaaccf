"""RouteWatch: which route directives interrupt a route the gateway drives (pure parts)."""

from __future__ import annotations

from gateway.route_watch import RouteWatch, failure_of_abort
from schemas.route import Hop, RouteDirective, RouteFailure, RouteSession

SESSION = RouteSession(
    session_id="s1", route_id="r1", model="m", model_revision="rev", cache_abi="abi", n_layer=30,
    hidden_size=576, n_ctx=2048,
    hops=[Hop(node_id="head", activation_url="http://127.0.0.1:1", layer_start=0, layer_end=15),
          Hop(node_id="tail", activation_url="http://127.0.0.1:2", layer_start=15, layer_end=30)])


def test_the_trackers_abort_for_a_lost_node_names_it() -> None:
    d = RouteDirective(action="abort", session=SESSION, issued_by="tracker-1", reason="node tail expired",
                       lost_node_id="tail")
    f = failure_of_abort(d)
    assert f is not None and f.code == "hop_lost" and f.node_id == "tail" and f.hop_index == 1
    assert "node tail expired" in f.reason
    plain = failure_of_abort(RouteDirective(action="abort", session=SESSION, issued_by="tracker-1"))
    assert plain is not None and plain.code == "session_aborted" and plain.node_id is None


def test_opens_closes_and_the_gateways_own_aborts_interrupt_nothing() -> None:
    watch, got = RouteWatch(), []
    unwatch = watch.watch("r1", got.append)
    for d in (RouteDirective(action="open", session=SESSION),
              RouteDirective(action="close", session=SESSION, issued_by="tracker-1"),
              RouteDirective(action="abort", session=SESSION, issued_by="gateway", lost_node_id="tail"),
              RouteDirective(action="abort", session=SESSION.model_copy(update={"route_id": "r2"}),
                             issued_by="tracker-1")):
        watch.on_directive(d)
    assert got == []
    watch.on_directive(RouteDirective(action="abort", session=SESSION, issued_by="tracker-1", lost_node_id="head"))
    assert len(got) == 1 and isinstance(got[0], RouteFailure) and got[0].node_id == "head"
    unwatch()
    watch.on_directive(RouteDirective(action="abort", session=SESSION, issued_by="tracker-1"))
    assert len(got) == 1 and watch.interrupted == 1
