"""The gateway records one validation AuditEvent per ended Route Session in JetStream.

Real nats-server (JetStream) and the real tokenizer; the route is the scripted one of
test_gateway_api.py (this test is about what the gateway records, not about the route).
A sampled session's digests are under a salt only the gateway's ReplayVault record holds; no
audit event a monitor reads carries an unsalted digest of a prompt or an output.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
from typing import Any

import aiohttp
import orjson
import pytest

from bus import subjects
from bus.client import Bus, Subscription
from gateway.audit_publisher import AuditPublisher
from gateway.state import AUDIT, METRICS, VAULT
from gateway.validation import validation_event
from schemas.audit import AUDIT_EVENT_ADAPTER, DIGEST_SCHEME, ValidationEvent, token_ids_digest
from schemas.base import BusMessage
from schemas.route import Hop, RouteSession
from tests import test_gateway_api as api
from tests.fixtures.nats import BusFactory
from tests.test_gateway_api import MSG, Edge, _byte_tokens, _post, _sse_data

# the scripted-route gateway of test_gateway_api.py, shared as fixtures
edge = api.edge
http = api.http
tokenizer = api.tokenizer


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    """No sampling by rate: only the sessions a test flags are sampled."""
    return {"validate_rate": 0.0}


async def _stored_after(
    sub: Subscription[ValidationEvent], n: int, edge: Edge, reader: Bus
) -> list[ValidationEvent]:
    """Wait for `n` validation events on the bus, then return every one JetStream stored."""
    seen = 0
    async for _ in sub:
        seen += 1
        if seen == n:
            break
    await edge.runner.app[AUDIT].queue.join()  # each publish got its JetStream ack
    stored: list[dict[str, Any]] = await reader.audit_messages()
    events = [AUDIT_EVENT_ADAPTER.validate_python(m) for m in stored]
    assert all(isinstance(e, ValidationEvent) for e in events)
    return [e for e in events if isinstance(e, ValidationEvent)]


def _has_output(event: ValidationEvent, ids: list[int], salt: bytes | None = None) -> bool:
    """The event records these output ids: their count, and (a sampled session's, under
    `salt`) their digest; a session not sampled records no digest."""
    digest = token_ids_digest(ids, salt) if salt is not None else None
    return (event.output_tokens, event.output_digest) == (len(ids), digest)


def unsalted_sha256(ids: list[int]) -> str:
    """The plain sha256 of ids packed as little-endian uint32: what a monitor could compute."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()


def _validations(reader: Bus) -> Subscription[ValidationEvent]:
    return reader.subscribe(subjects.audit_kind("validation"), ValidationEvent)


async def test_completed_session_records_route_seed_prompt_and_output(
    edge: Edge, http: aiohttp.ClientSession, bus_factory: BusFactory
) -> None:
    reader = await bus_factory("tracker")
    text = "Paris é"
    output = _byte_tokens(edge.tokenizer, text)
    edge.script.tokens = [*output, min(edge.tokenizer.eog_ids)]
    async with _validations(reader) as sub:
        await reader.flush()
        status, headers, raw = await _post(http, edge.url, {
            "model": "bundled", "messages": MSG, "temperature": 0.8, "top_p": 0.9, "seed": 1234})
        body = orjson.loads(raw)
        assert status == 200 and body["choices"][0]["message"]["content"] == text
        [event] = await _stored_after(sub, 1, edge, reader)
    assert await reader.audit_count("mesh.audit.validation.gateway") == 1
    session_id = headers["x-route-session-id"]
    assert event.session_id == session_id and event.source == "gateway"
    assert event.route_id == "r-1"  # the scripted tracker's route for this request
    assert [(h.node_id, h.layer_start, h.layer_end) for h in event.hops] == [
        ("head", 0, 15), ("tail", 15, 30)]
    assert event.model_revision == edge.requests[-1].model
    assert (event.sampling.seed, event.sampling.temperature, event.sampling.top_p) == (
        1234, 0.8, 0.9)
    prompt = edge.tokenizer.encode_chat(MSG)
    assert event.prompt_tokens == len(prompt) == body["usage"]["prompt_tokens"]
    # not sampled: no digests at all (nobody could check them); never ids or text: monitors read this
    assert (event.sampled, event.digest_scheme, event.prompt_digest) == (False, None, None)
    assert _has_output(event, output)  # the tokens whose text was returned (no EOG)
    assert b"".join(edge.tokenizer.token_bytes(t) for t in output).decode() == text
    assert event.output_ref == session_id  # what a validator asks the gateway for the ids by
    stored = orjson.dumps(event.model_dump())
    assert b"token_ids" not in stored and text.encode() not in stored
    assert (event.outcome, event.finish_reason, event.failed_phase) == ("completed", "stop", None)
    assert edge.runner.app[METRICS].audit_events.value(
        kind="validation", outcome="published") == 1


async def test_streamed_length_limit_and_failed_session_are_recorded(
    edge: Edge, http: aiohttp.ClientSession, bus_factory: BusFactory
) -> None:
    reader = await bus_factory("tracker")
    async with _validations(reader) as sub:
        await reader.flush()
        edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
        status, headers, raw = await _post(http, edge.url, {
            "model": "bundled", "messages": MSG, "max_tokens": 5, "stream": True, "seed": 7})
        assert status == 200
        chunks = [orjson.loads(d) for d in _sse_data(raw)[:-1]]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert streamed == "abcde"
        ok_id = headers["x-route-session-id"]

        edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
        edge.script.fail_phase, edge.script.fail_after = "decode", 3
        status, headers, raw = await _post(http, edge.url, {
            "model": "bundled", "messages": MSG, "seed": 9},
            headers={"x-route-session-id": "fails-in-decode", "x-meshnet-restart": "off"})
        assert status == 502
        events = {e.session_id: e for e in await _stored_after(sub, 2, edge, reader)}
    assert set(events) == {ok_id, "fails-in-decode"}
    ok = events[ok_id]
    assert (ok.outcome, ok.finish_reason, ok.sampling.seed) == ("completed", "length", 7)
    assert _has_output(ok, _byte_tokens(edge.tokenizer, "abcde"))
    failed = events["fails-in-decode"]
    assert (failed.outcome, failed.failed_phase, failed.finish_reason) == ("failed", "decode", None)
    assert failed.failure_reason is not None and "connection reset" in failed.failure_reason
    assert failed.sampling.seed == 9 and failed.route_id == "r-2"
    # prefill gave "a", three decode steps "bcd", the fourth step lost the tail
    assert _has_output(failed, _byte_tokens(edge.tokenizer, "abcd"))


async def test_a_restarted_session_records_every_route_and_where_each_took_over(
    edge: Edge, http: aiohttp.ClientSession, bus_factory: BusFactory
) -> None:
    edge.script.tokens = _byte_tokens(edge.tokenizer, "abcdefgh")
    edge.script.fail_phase, edge.script.fail_after, edge.script.fail_routes = "decode", 3, 1
    reader = await bus_factory("tracker")
    async with _validations(reader) as sub:
        await reader.flush()
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG, "max_tokens": 8},
                                     headers={"x-route-session-id": "moved"})
        assert status == 200, raw
        [event] = await _stored_after(sub, 1, edge, reader)
    assert event.outcome == "completed" and _has_output(event, _byte_tokens(edge.tokenizer, "abcdefgh"))
    assert [(r.session_id, r.route_id, r.epoch, r.from_token) for r in event.routes] == [
        ("moved", "r-1", 1, 0), ("moved-e2", "r-2", 2, 4)]  # the lost route made 4 tokens, the new one the rest


async def test_full_audit_queue_drops_and_counts_without_waiting(bus_factory: BusFactory) -> None:
    gateway_bus = await bus_factory("gateway")
    reader = await bus_factory("tracker")
    session = RouteSession(
        session_id="s", route_id="r", model="m", model_revision="rev", cache_abi="abi", n_layer=30,
        hidden_size=576, n_ctx=256,
        hops=[Hop(node_id="n1", activation_url="http://127.0.0.1:9", layer_start=0, layer_end=30)])
    events = [validation_event(session, prompt_ids=[1, 2], output_ids=[i], finish_reason="stop")
              for i in range(3)]
    publisher = AuditPublisher(gateway_bus, max_queue=2)
    assert [publisher.offer(e) for e in events] == [True, True, False]  # no task yet: full
    assert publisher.events.value(kind="validation", outcome="dropped") == 1
    task = asyncio.create_task(publisher.run())
    try:
        await publisher.queue.join()  # every queued event handled
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert publisher.events.value(kind="validation", outcome="published") == 2
    stored = await reader.audit_messages()
    assert [m["event_id"] for m in stored] == [e.event_id for e in events[:2]]


async def test_no_audit_event_carries_an_unsalted_digest_of_the_prompt_or_the_output(
    edge: Edge, http: aiohttp.ClientSession, bus_factory: BusFactory
) -> None:
    monitor, reader = await bus_factory("monitor"), await bus_factory("tracker")
    prompt = edge.tokenizer.encode_chat(MSG)
    output = _byte_tokens(edge.tokenizer, "Paris")
    seen: list[BusMessage] = []
    async with monitor.subscribe_any(subjects.AUDIT_ALL) as everything, _validations(reader) as sub:
        await monitor.flush()
        await reader.flush()
        for validate in ("on", "off"):  # a flagged (sampled) session, then one not sampled
            edge.script.tokens = [*output, min(edge.tokenizer.eog_ids)]
            status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG},
                                         headers={"x-meshnet-validate": validate})
            assert status == 200, raw
        events = {e.sampled: e for e in await _stored_after(sub, 2, edge, reader)}
        async with asyncio.timeout(10):  # the monitor's copy of what the gateway published
            async for msg in everything:
                seen.append(msg)
                if sum(isinstance(m, ValidationEvent) for m in seen) == 2:
                    break
    sampled, plain = events[True], events[False]
    record = edge.runner.app[VAULT].take(sampled.session_id)  # what the validator would fetch
    assert record is not None and record.prompt_ids == prompt and record.output_ids == output
    salt = record.salt()
    assert sampled.digest_scheme == DIGEST_SCHEME and sampled.prompt_digest == token_ids_digest(prompt, salt)
    assert _has_output(sampled, output, salt) and _has_output(plain, output)
    assert (plain.digest_scheme, plain.prompt_digest) == (None, None)
    # neither the monitor's messages nor the stored stream hold an unsalted digest, or the salt
    published = [m.to_json() for m in seen] + [orjson.dumps(m) for m in await reader.audit_messages()]
    assert len(published) >= 4
    for secret in (unsalted_sha256(prompt), unsalted_sha256(output), record.digest_salt):
        assert not any(secret.encode() in raw for raw in published), secret


async def test_metrics_count_the_sessions_sampled_and_the_verdicts_heard(
    edge: Edge, http: aiohttp.ClientSession, bus_factory: BusFactory
) -> None:
    """An operator at --validate-rate 1 could not tell from /metrics whether validation kept up:
    nothing counted the sessions sampled or the verdicts. Both are counted now."""
    from schemas.audit import ValidationVerdict
    from schemas.sampling import SamplingParams

    output = _byte_tokens(edge.tokenizer, "Paris")
    for validate in ("on", "off"):
        edge.script.tokens = [*output, min(edge.tokenizer.eog_ids)]
        status, _, raw = await _post(http, edge.url, {"model": "bundled", "messages": MSG},
                                     headers={"x-meshnet-validate": validate})
        assert status == 200, raw
    metrics = edge.runner.app[METRICS]
    assert metrics.sampled.value() == 1
    validator = await bus_factory("validator")
    verdict = ValidationVerdict(
        source="validator", session_id="s", route_id="r", validator_id="v", validation_event_id="e" * 8,
        model="m", model_revision="rev", sampling=SamplingParams(), prompt_tokens=1, original_routes=[],
        replay_backend="llama.cpp", output_tokens=1, compared_tokens=1, tolerance=0.0, outcome="pass")
    async with asyncio.timeout(10):
        while metrics.verdicts.value(outcome="pass") < 1:
            await validator.publish(subjects.audit(subjects.VERDICT_KIND, "validator"), verdict)
            await asyncio.sleep(0.2)
    async with http.get(f"{edge.url}/metrics") as resp:
        text = await resp.text()
    assert "meshnet_gateway_sessions_sampled_total 1" in text
    assert 'meshnet_gateway_validation_verdicts_total{outcome="pass"}' in text
