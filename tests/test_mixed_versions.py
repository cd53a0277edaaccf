"""Mixed versions in one mesh (schemas/protocol.py): what a newer gateway or tracker sends an
older node is what the older node reads, unless the request uses something only newer nodes do.

tests/fixtures/protocol1_fields.json holds the field names of the strict models (extra="forbid")
at protocol 1 (commit e590058): an older reader refuses a message carrying any other field."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from gateway.chat_request import parse_chat_request
from schemas.protocol import FIRST, PROTOCOL, Versioned, field_since, needs
from schemas.route import RouteDirective, RouteRequest, RouteSession
from schemas.sampling import SamplingParams

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
