"""Bus message schemas: JSON round trips and typed SchemaErrors."""

from __future__ import annotations

import orjson
import pytest

from schemas.audit import (
    AUDIT_EVENT_ADAPTER,
    DIGEST_SCHEME,
    NodeWork,
    RouteParticipation,
    ValidationEvent,
)
from schemas.base import SchemaError
from schemas.capability import CapabilityReport, ShardRange
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.rebalance import RebalanceDirective
from schemas.registry import MESSAGE_TYPES, UnknownMessage, parse_message
from schemas.route import Hop, RouteWithdrawal
from schemas.sampling import SamplingParams
from schemas.tracker import TrackerHello, TrackerStatus
from schemas.validation import UnquarantineRequest

CAP = CapabilityReport(
    model_arch="llama", model_name="smol", model_revision="rev", runtime="llama.cpp",
    layers=ShardRange(start=0, end=15, n_layer=30), hidden_size=576, vocab_size=49152,
    n_ctx=4096, cache_abi="abi", cache_bytes_per_token=1,
)  # fmt: skip

EXAMPLES = [
    NodeAnnouncement(node_id="n1", activation_url="http://127.0.0.1:7101", capability=CAP, started_at=5.0),
    NodeHeartbeat(node_id="n1", load=0.5, queue_depth=2, decode_tokens_per_second=150.0, sessions=3,
                  cache_bytes=1 << 20, free_session_slots=1),
    RebalanceDirective(node_id="n1", model="smol", layer_start=15, layer_end=30, n_layer=30, reason="gap"),
    TrackerHello(tracker_id="t", node_ids=["n1"]),
    TrackerStatus(tracker_id="t", n_nodes=0),
    RouteParticipation(source="tracker", session_id="s", route_id="r", model="smol", model_revision="rev",
                       cache_abi="abi", node_id="n1", layer_start=0, layer_end=15, hop_index=0, n_hops=2),
    NodeWork(source="n1", session_id="s", route_id="r", node_id="n1", model_revision="rev",
             layer_start=0, layer_end=15, prefill_tokens=10, decode_tokens=5),
    ValidationEvent(source="gateway", session_id="s", route_id="r", model="smol", model_revision="rev",
                    cache_abi="abi", hops=[Hop(node_id="n1", activation_url="u", layer_start=0, layer_end=30)],
                    sampling=SamplingParams(temperature=0.7, seed=42), digest_scheme=DIGEST_SCHEME,
                    prompt_digest="ab" * 32, output_digest="cd" * 32, output_tokens=2, output_ref="s", sampled=True),
    RouteWithdrawal(request_id="r1", session_id="s", reason="the asker left"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.TYPE)
def test_roundtrip_and_dispatch_by_type(msg) -> None:  # type: ignore[no-untyped-def]
    raw = msg.to_json()
    assert orjson.loads(raw)["type"] == msg.TYPE
    assert type(msg).from_json(raw) == msg
    assert parse_message(raw) == msg
    assert MESSAGE_TYPES[msg.TYPE] is type(msg)


def test_an_announcement_from_before_the_weight_fields_still_validates() -> None:
    old = orjson.loads(EXAMPLES[0].to_json())
    for key in ("param_bytes", "active_param_bytes_per_token", "expert_count", "expert_used_count"):
        del old["capability"][key]
    got = NodeAnnouncement.from_json(orjson.dumps(old))
    assert got.capability.active_param_bytes_per_token == got.capability.expert_count == 0
    moe = CAP.model_copy(update={"param_bytes": 40, "active_param_bytes_per_token": 22, "expert_count": 8,
                                 "expert_used_count": 2})
    assert CapabilityReport.model_validate_json(moe.model_dump_json()) == moe


def test_work_units_are_tokens_times_layers() -> None:
    work = NodeWork(source="n", session_id="s", route_id="r", node_id="n", model_revision="rev",
                    layer_start=10, layer_end=25, prefill_tokens=100, decode_tokens=20)
    assert (work.n_layers, work.work_units) == (15, 120 * 15)
    with pytest.raises(ValueError):
        NodeWork(source="n", session_id="s", route_id="r", node_id="n", model_revision="rev",
                 layer_start=10, layer_end=25, prefill_tokens=1, work_units=7)


def test_audit_events_are_discriminated_by_kind() -> None:
    raw = orjson.loads(EXAMPLES[6].to_json())
    assert isinstance(AUDIT_EVENT_ADAPTER.validate_python(raw), NodeWork)


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"\xff\xfe", "malformed"),
        (b'"just a string"', "malformed"),
        (b'{"v": 2, "node_id": "n1"}', "unknown_version"),
        (b'{"node_id": "n1"}', "unknown_version"),
        (b'{"v": 1, "node_id": "bad id with spaces"}', "invalid"),
        (b'{"v": 1, "node_id": "n1", "sessions": "many"}', "invalid"),
    ],
)
def test_bad_input_is_a_typed_schema_error(raw: bytes, kind: str) -> None:
    with pytest.raises(SchemaError) as err:
        NodeHeartbeat.from_json(raw, subject="mesh.node.n1.heartbeat")
    assert err.value.kind == kind
    assert err.value.subject == "mesh.node.n1.heartbeat"
    if kind != "invalid":
        with pytest.raises(SchemaError):
            parse_message(raw)


def test_rebalance_range_is_checked() -> None:
    with pytest.raises(ValueError):
        RebalanceDirective(node_id="n", model="m", layer_start=5, layer_end=5, reason="x")
    with pytest.raises(ValueError):
        RebalanceDirective(node_id="n", model="m", layer_start=5, layer_end=31, n_layer=30, reason="x")


def test_unknown_type_is_kept_for_monitors() -> None:
    msg = parse_message(b'{"v": 1, "type": "future.thing", "x": 1}')
    assert isinstance(msg, UnknownMessage) and msg.type_name == "future.thing"


def test_a_message_of_another_type_is_told_apart_not_misread() -> None:
    """Two message families share mesh.session.<id>.telemetry; each reader sees only its own."""
    from schemas.telemetry import GenerationTelemetry, HopTelemetry

    hop = HopTelemetry(session_id="s1", route_id="r1", node_id="n0", hop_index=0,
                       layer_start=0, layer_end=15, phase="prefill")
    with pytest.raises(SchemaError) as info:
        GenerationTelemetry.from_json(hop.to_json())
    assert info.value.kind == "other_type"
    assert HopTelemetry.from_json(hop.to_json()) == hop


@pytest.mark.parametrize("node_id", ["x" * 5000, "a b", "a.b", "*", ">", ""])
def test_an_unquarantine_request_names_a_node_id_a_subject_can_carry(node_id: str) -> None:
    """The tracker writes a lift under its node id as a MESH_QUARANTINE key: an operator's
    request for 5,000 x's overran NATS's control line, the server dropped the tracker's
    connection and the mesh had no tracker from then on. Such an id is now a SchemaError,
    which the tracker's request handler skips."""
    raw = orjson.dumps({"v": 1, "type": "tracker.unquarantine", "node_id": node_id})
    with pytest.raises(SchemaError):
        UnquarantineRequest.from_json(raw)
    assert UnquarantineRequest.from_json(orjson.dumps({"v": 1, "node_id": "node-0"})).node_id == "node-0"
