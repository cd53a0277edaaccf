"""Mixed versions in one mesh (schemas/protocol.py): what a newer gateway or tracker sends an
older node is what the older node reads, unless the request uses something only newer nodes do.

tests/fixtures/protocol1_fields.json holds the field names of the strict models (extra="forbid")
at protocol 1 (commit e590058): an older reader refuses a message carrying any other field."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from pydantic import BaseModel

from gateway.chat_request import parse_chat_request
from gateway.errors import RouteUnavailableError
from gateway.routing import Router, older_tracker
from schemas.base import SchemaError
from schemas.capability import CapabilityReport, ShardRange
from schemas.node import NodeAnnouncement
from schemas.protocol import FIRST, PROTOCOL, Versioned, field_since, needs
from schemas.route import RouteDirective, RouteError, RouteRequest, RouteSession
from schemas.sampling import SamplingParams
from tests.fixtures.nats import BusFactory
from tests.test_gateway_e2e import running_mesh
from tracker.routing import RouteQuery, build_index, plan_route, select_route
from tracker.service import Tracker, TrackerConfig
from tracker.spread import SpreadSession, plan_spread
from tracker.views import NodeView

PROTOCOL1 = json.loads((Path(__file__).parent / "fixtures" / "protocol1_fields.json").read_text())
MSG = [{"role": "user", "content": "hi"}]


def _model(path: str) -> type[BaseModel]:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _protocol1_reads(sampling: dict[str, Any]) -> bool:
    """Whether a protocol 1 reader's SamplingParams (extra="forbid") takes this JSON object."""
    known = set(PROTOCOL1["models"]["schemas.sampling.SamplingParams"])
    constraint = sampling.get("constraint") or {}
    return set(sampling) <= known and set(constraint) <= set(PROTOCOL1["models"]["schemas.output_constraint.OutputConstraint"])


@pytest.mark.parametrize("body", [
    {},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7},
    {"temperature": 1.0, "presence_penalty": 0.5, "logit_bias": {"42": 3}, "logprobs": True, "top_logprobs": 2},
    {"response_format": {"type": "json_object"}},
    # llama-server's `samplers` in an order that gives what the default order gives
    {"temperature": 0.7, "top_k": 40, "samplers": ["top_k", "temperature"]},
    {"temperature": 0, "top_p": 0.5, "samplers": "pkt"},
])
def test_a_request_using_no_new_feature_is_read_by_a_protocol_1_node(body: dict[str, Any]) -> None:
    """Before: the gateway's route request and the tracker's open directive carried `order`
    (added after e590058) at its default too, so an older node dropped every directive ('Extra
    inputs are not permitted') and every request failed 15 s later (unknown_session after two
    restarts), and an older tracker refused every request (400 bad_request)."""
    sampling = parse_chat_request({"model": "m", "messages": MSG, **body}).sampling
    request = orjson.loads(RouteRequest(model="m", sampling=sampling).to_json())
    assert _protocol1_reads(request["sampling"]), sorted(request["sampling"])
    session = RouteSession(session_id="s", route_id="r", model="m", model_revision="rev", cache_abi="abi",
                           n_layer=30, hidden_size=576, n_ctx=2048, hops=[], sampling=sampling)
    directive = orjson.loads(RouteDirective(action="open", session=session).to_json())
    assert _protocol1_reads(directive["session"]["sampling"])
    assert needs(sampling) == (FIRST, ())
    assert RouteRequest.from_json(RouteRequest(model="m", sampling=sampling).to_json()).sampling == sampling


def test_a_request_whose_samplers_change_the_answer_needs_protocol_2() -> None:
    """An order that changes the candidates is sent, never dropped: an older node would sample
    in its own order, a different answer. The request needs protocol 2 and says which field."""
    body = {"model": "m", "messages": MSG, "temperature": 0.8, "top_p": 0.9, "min_p": 0.05,
            "samplers": ["top_p", "min_p", "temperature"]}
    sampling = parse_chat_request(body).sampling
    request = orjson.loads(RouteRequest(model="m", sampling=sampling).to_json())
    assert request["sampling"]["order"] == ["top_p", "min_p", "temperature", "top_k"]
    assert not _protocol1_reads(request["sampling"])
    assert needs(sampling) == (2, ("order",))
    assert needs(RouteRequest(model="m", sampling=sampling)) == (2, ("sampling.order",))
    assert PROTOCOL >= 2


@pytest.mark.parametrize("path", sorted(PROTOCOL1["models"]))
def test_every_field_added_since_protocol_1_is_declared_with_its_protocol(path: str) -> None:
    """The guard for the next change: a field added to a strict model must say which protocol
    reads it (schemas.protocol.since) and be left out at its default (Versioned), else an
    older node drops every message of that model."""
    model = _model(path)
    added = sorted(set(model.model_fields) - set(PROTOCOL1["models"][path]))
    for name in added:
        assert 1 < field_since(model, name) <= PROTOCOL, f"{path}.{name} has no since(n)"
    if added:
        assert issubclass(model, Versioned), f"{path} has fields newer than protocol 1 but is not Versioned"


def test_a_default_sampling_dump_holds_only_protocol_1_fields() -> None:
    assert set(SamplingParams().model_dump(mode="json")) == set(PROTOCOL1["models"]["schemas.sampling.SamplingParams"])


# -- routing over nodes of different protocols (tracker/routing.py, tracker/spread.py) ---------

ORDERED = SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, order=("top_p", "min_p", "temperature", "top_k"))


def view(node_id: str, start: int, end: int, protocol: int = PROTOCOL, tps: float = 100.0) -> NodeView:
    return NodeView(node_id=node_id, activation_url=f"http://{node_id}", model="m", model_revision="r",
                    cache_abi="c", start=start, end=end, n_layer=30, hidden_size=576, decode_tps=tps,
                    free_slots=4, max_sessions=4, protocol=protocol)


def route(views: list[NodeView], sampling: SamplingParams) -> list[str] | RouteError:
    plan = plan_route(build_index(views), RouteQuery.from_request(RouteRequest(model="m", sampling=sampling)))
    return plan if isinstance(plan, RouteError) else [v.node_id for v in plan.hops]


@pytest.mark.parametrize(("name", "views", "sampling", "want"), [
    ("an old node serves a request that uses nothing newer",
     [view("head", 0, 15), view("old-tail", 15, 30, protocol=1)], SamplingParams(temperature=0.7, top_k=40),
     ["head", "old-tail"]),
    ("a request with a new field takes the new replica, though the old one is faster",
     [view("head", 0, 15), view("old-tail", 15, 30, protocol=1, tps=500.0), view("new-tail", 15, 30)],
     ORDERED, ["head", "new-tail"]),
    ("the faster old replica is taken when nothing newer is needed",
     [view("head", 0, 15), view("old-tail", 15, 30, protocol=1, tps=500.0), view("new-tail", 15, 30)],
     SamplingParams(), ["head", "old-tail"]),
    ("an old whole-model node and a new chain: the chain",
     [view("old-all", 0, 30, protocol=1), view("head", 0, 15), view("tail", 15, 30)], ORDERED, ["head", "tail"]),
])
def test_routing_by_protocol(name: str, views: list[NodeView], sampling: SamplingParams,
                             want: list[str]) -> None:
    assert route(views, sampling) == want, name


def test_a_request_whose_every_route_crosses_an_older_node_is_refused_incompatible_naming_it() -> None:
    """Before: the tracker routed it through the older node, which dropped the open directive;
    the client's stream failed 15 s later (unknown_session after two restarts)."""
    views = [view("head", 0, 15), view("old-tail", 15, 30, protocol=1), view("old-tail-2", 15, 30, protocol=1)]
    err = route(views, ORDERED)
    assert isinstance(err, RouteError) and err.code == "incompatible", err
    assert "sampling.order needs mesh protocol 2" in err.message
    assert "old-tail (protocol 1), old-tail-2 (protocol 1)" in err.message
    assert "samplers" in err.message
    # a layer nobody serves is still no_coverage, old nodes counted as serving theirs
    gap = route([view("old-head", 0, 15, protocol=1)], ORDERED)
    assert isinstance(gap, RouteError) and gap.code == "no_coverage" and gap.missing_ranges == [(15, 30)]


def test_an_announcement_without_protocol_is_a_protocol_1_node() -> None:
    """e590058's nodes announce no protocol; this code's announce PROTOCOL."""
    cap = CapabilityReport(model_arch="llama", model_name="m", model_revision="r", runtime="llama.cpp",
                           layers=ShardRange(start=0, end=30, n_layer=30), hidden_size=576, vocab_size=49152,
                           n_ctx=4096, cache_abi="c", cache_bytes_per_token=1024)
    new = NodeAnnouncement(node_id="n", activation_url="http://n", capability=cap, started_at=1.0, protocol=PROTOCOL)
    raw = orjson.loads(new.to_json())
    assert raw["protocol"] == PROTOCOL
    del raw["protocol"]
    assert NodeAnnouncement.from_json(orjson.dumps(raw)).protocol == FIRST


def test_a_hop_carries_its_nodes_announced_window_and_an_older_nodes_is_1() -> None:
    """A sender posts a hop's window of frames before the first ack (wire/link.py); a node of
    before the field announces none, and its sessions grant only frame 0 until they ack."""
    cap = CapabilityReport(model_arch="llama", model_name="m", model_revision="r", runtime="llama.cpp",
                           layers=ShardRange(start=0, end=30, n_layer=30), hidden_size=576, vocab_size=49152,
                           n_ctx=4096, cache_abi="c", cache_bytes_per_token=1024)
    raw = orjson.loads(NodeAnnouncement(node_id="n", activation_url="http://n", capability=cap, started_at=1.0,
                                        window=4).to_json())
    assert raw["window"] == 4
    del raw["window"]
    assert NodeAnnouncement.from_json(orjson.dumps(raw)).window == 1
    views = [dataclasses.replace(view("head", 0, 15), window=4), view("old-tail", 15, 30, protocol=1)]
    session = select_route(build_index(views), RouteRequest(model="m"), session_id="s", route_id="r")
    assert not isinstance(session, RouteError)
    assert [h.window for h in session.hops] == [4, 1]


def test_the_spreader_never_moves_a_session_onto_an_older_replica_it_needs_newer_than() -> None:
    views = [view("h", 0, 15), view("t-new", 15, 30), view("t-old", 15, 30, protocol=1)]
    live = {"h": 8, "t-new": 8, "t-old": 8}

    def sessions(protocol: int) -> list[SpreadSession]:
        return [SpreadSession(f"r{i}", float(i), ("h", "t-new"), protocol=protocol) for i in range(4)]

    assert [m.to_node for m in plan_spread(views, sessions(FIRST), live=live, now=10.0)] == ["t-old", "t-old"]
    assert plan_spread(views, sessions(2), live=live, now=10.0) == []


# -- a real mesh: a new gateway and tracker, a new head and a tail announcing protocol 1 --------

# `meshnet node` as a node of e590058 looks to the mesh (a sitecustomize.py the node process
# imports at start): it announces no protocol (1), and drops a whole open directive whose
# sampling carries `order` (e590058's strict SamplingParams)
OLD_NODE = """
import nodes.server.presence as presence
from schemas.base import SchemaError
from schemas.route import RouteDirective
presence.PROTOCOL = 1
_parse = RouteDirective.from_json.__func__
def strict(cls, raw, subject=None):
    if b'"order"' in raw:
        raise SchemaError("invalid route.directive: 1 error(s): Extra inputs are not permitted",
                          kind="invalid", subject=subject)
    return _parse(cls, raw, subject)
RouteDirective.from_json = classmethod(strict)
"""


def old_node_env(tmp: Path) -> dict[str, str]:
    """The environment that makes a test's `meshnet node` look like a node of e590058."""
    shim = tmp / "protocol1"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(OLD_NODE)
    root = Path(__file__).resolve().parent.parent
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), str(root), os.environ.get("PYTHONPATH")) if p)}


async def test_a_mixed_mesh_serves_old_requests_and_refuses_new_fields_before_the_stream(
        model_path: Path, tmp_path: Path) -> None:
    """Before: every request through the protocol 1 tail failed 15 s in (its open directive carried
    `order` and was dropped; unknown_session after two restarts, on a stream after its first
    chunk). Now a request using nothing newer is answered through it, and one whose `samplers`
    change the answer is a 503 `incompatible` naming the node, before any stream starts."""
    nodes = {"mv-head": "0:15", "mv-old-tail": "15:30"}
    async with (running_mesh(model_path, tmp_path, nodes, node_args={"mv-old-tail": ([], old_node_env(tmp_path))})
                as mesh, aiohttp.ClientSession() as http):
        assert mesh.tracker.registry.get("mv-old-tail").announcement.protocol == 1
        url = f"{mesh.url}/v1/chat/completions"
        body = {"model": "smollm2-135m-instruct", "messages": MSG, "max_tokens": 8, "temperature": 0}
        async with http.post(url, json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            assert answer["usage"]["completion_tokens"] > 0
        ordered = {**body, "temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "samplers": ["top_p", "min_p", "temperature"]}
        for stream in (False, True):
            async with http.post(url, json={**ordered, "stream": stream}) as resp:
                err = (await resp.json(content_type=None))["error"]
                assert resp.status == 503 and err["code"] == "incompatible", err
                assert "mv-old-tail (protocol 1)" in err["message"] and "protocol 2" in err["message"], err
                # a retry in a second meets the same nodes: an OpenAI SDK is told not to
                assert resp.headers.get("x-should-retry") == "false" and "Retry-After" not in resp.headers


# -- a newer gateway, an older tracker --------------------------------------------------------


async def test_an_older_trackers_refusal_of_a_new_field_is_a_503_naming_it(
        bus_factory: BusFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real tracker that reads route requests as e590058's does (its strict SamplingParams
    refuses `order`). Before: the client got 400 bad_request 'the tracker refused the request:
    invalid route.request: 1 error(s): Extra inputs are not permitted', as if its request were
    wrong. A request using nothing newer is read as before."""
    parse = RouteRequest.from_json.__func__  # type: ignore[attr-defined]

    def strict(cls: type[RouteRequest], raw: bytes, subject: str | None = None) -> RouteRequest:
        if b'"order"' in raw:
            raise SchemaError("invalid route.request: 1 error(s): Extra inputs are not permitted",
                              kind="invalid", subject=subject)
        return parse(cls, raw, subject)  # type: ignore[no-any-return]

    monkeypatch.setattr(RouteRequest, "from_json", classmethod(strict))
    async with Tracker(await bus_factory("tracker"), TrackerConfig()):
        router = Router(await bus_factory("gateway"), timeout=30.0)
        with pytest.raises(RouteUnavailableError) as plain:
            await router.create(RouteRequest(model="smol", sampling=SamplingParams(temperature=0.7, top_k=40)))
        assert plain.value.route_code == "no_nodes"  # read, and answered: nobody serves smol
        with pytest.raises(RouteUnavailableError) as ordered:
            await router.create(RouteRequest(model="smol", sampling=ORDERED))
    err = ordered.value
    assert err.status == 503 and err.route_code == "incompatible" and err.final, err
    assert "sampling.order needs mesh protocol 2" in str(err) and "older Meshnet" in str(err)
    assert "samplers" in str(err)


def test_a_bad_request_for_another_reason_stays_a_400() -> None:
    wrong = RouteError(code="bad_request", message="invalid route.request: 1 error(s): model: Field required")
    assert older_tracker(wrong, RouteRequest(model="m", sampling=ORDERED)) == wrong
    extra = RouteError(code="bad_request", message="invalid route.request: 1 error(s): Extra inputs are not permitted")
    assert older_tracker(extra, RouteRequest(model="m")) == extra  # nothing newer used: not a version skew
